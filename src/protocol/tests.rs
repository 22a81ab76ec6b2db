//! Tests of the line protocol: framing, parsing and key canonicalisation, by example and by
//! property.

use super::framing::*;
use super::keys::*;
use super::parse::*;
use super::reject::Reject;
use proptest::prelude::*;
use std::hash::{Hash, Hasher};

const HITS: u16 = 0;
const USERS: u16 = 1;
const DOCS: u16 = 2;
const IPS: u16 = 3;

fn counters() -> Counters {
    Counters::new([
        ("hits", KeyType::Text),
        ("users", KeyType::Bigint),
        ("docs", KeyType::Uuid),
        ("ips", KeyType::Inet),
    ])
}

fn parse(line: &[u8]) -> Result<Line<'_>, Reject> {
    parse_line(line, &counters(), &Limits::default())
}

fn event(line: &[u8]) -> Event<'_> {
    match parse(line) {
        Ok(Line::Event(e)) => e,
        other => panic!(
            "{:?}: expected an event, got {other:?}",
            String::from_utf8_lossy(line)
        ),
    }
}

fn key_of(line: &str) -> String {
    event(line.as_bytes()).key.as_str().to_owned()
}

fn is_borrowed(line: &str) -> bool {
    matches!(event(line.as_bytes()).key, Key::Borrowed(_))
}

fn reject(line: &[u8]) -> Reject {
    match parse(line) {
        Err(r) => r,
        other => panic!(
            "{:?}: expected a reject, got {other:?}",
            String::from_utf8_lossy(line)
        ),
    }
}

fn inline(s: &str) -> Key<'static> {
    let mut k = InlineKey::new();
    k.push_ascii(s.as_bytes()).unwrap();
    Key::Inline(k)
}

// ---- events ----

#[test]
fn minimal_event_defaults_delta_to_one() {
    assert_eq!(
        parse(b"hits home"),
        Ok(Line::Event(Event {
            counter: HITS,
            key: Key::Borrowed("home"),
            delta: 1,
            value: None,
            at_ms: None
        }))
    );
}

#[test]
fn full_event() {
    assert_eq!(
        parse(b"users 42 -3 @1700000000123"),
        Ok(Line::Event(Event {
            counter: USERS,
            key: Key::Borrowed("42"),
            delta: -3,
            value: None,
            at_ms: Some(1_700_000_000_123)
        }))
    );
}

#[test]
fn deltas() {
    assert_eq!(event(b"hits k 5").delta, 5);
    assert_eq!(event(b"hits k +5").delta, 5);
    assert_eq!(event(b"hits k -5").delta, -5);
    assert_eq!(event(b"hits k 0").delta, 0);
    assert_eq!(event(b"hits k -0").delta, 0);
    assert_eq!(event(b"hits k 0000000000000000000000042").delta, 42);
    assert_eq!(event(b"hits k 9223372036854775807").delta, i64::MAX);
    assert_eq!(event(b"hits k -9223372036854775808").delta, i64::MIN);
    assert_eq!(
        event(b"hits k -0000000000009223372036854775808").delta,
        i64::MIN
    );
}

#[test]
fn bad_deltas() {
    for line in [
        &b"hits k 9223372036854775808"[..],
        b"hits k -9223372036854775809",
        b"hits k 18446744073709551616",
        b"hits k 99999999999999999999999999",
        b"hits k -",
        b"hits k +",
        b"hits k +-1",
        b"hits k --1",
        b"hits k 1.5",
        b"hits k 0x10",
        b"hits k 1e3",
        b"hits k abc",
        b"hits k 12a",
        b"hits k \xff",
        b"hits k \xef\xbc\x91", // fullwidth digit one
    ] {
        assert_eq!(
            reject(line),
            Reject::BadDelta,
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn timestamps() {
    let e = event(b"hits k @1700000000000");
    assert_eq!((e.delta, e.at_ms), (1, Some(1_700_000_000_000)));
    let e = event(b"hits k 7 @0");
    assert_eq!((e.delta, e.at_ms), (7, Some(0)));
    assert_eq!(
        event(b"hits k @253402300799999").at_ms,
        Some(253_402_300_799_999)
    );
    assert_eq!(event(b"hits k @000000000000000000000001").at_ms, Some(1));
}

#[test]
fn bad_timestamps() {
    for line in [
        &b"hits k @253402300800000"[..],
        b"hits k @99999999999999999999999",
        b"hits k @",
        b"hits k @-1",
        b"hits k @+1",
        b"hits k @12a",
        b"hits k @1.5",
        b"hits k 1 @",
        b"hits k 1 @x",
        b"hits k @@1",
    ] {
        assert_eq!(
            reject(line),
            Reject::BadTimestamp,
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn field_count() {
    assert_eq!(reject(b"hits"), Reject::MissingKey);
    assert_eq!(reject(b"  hits \t\r"), Reject::MissingKey);
    assert_eq!(reject(b"nope"), Reject::MissingKey);
    assert_eq!(reject(b"hits k 1 @2 x"), Reject::TooManyFields);
    assert_eq!(reject(b"hits k 1 @2 @3"), Reject::TooManyFields);
    assert_eq!(reject(b"hits k 1 2"), Reject::TooManyFields);
    assert_eq!(reject(b"hits k @1 2"), Reject::TooManyFields);
    assert_eq!(reject(b"hits k @1 @2"), Reject::TooManyFields);
    assert_eq!(reject(b"nope k 1 2 3 4 5"), Reject::TooManyFields);
}

#[test]
fn separators_tabs_and_crlf() {
    let expected = Event {
        counter: HITS,
        key: Key::Borrowed("k"),
        delta: 2,
        value: None,
        at_ms: Some(9),
    };
    for line in [
        &b"hits k 2 @9"[..],
        b"\thits \t k\t\t2  @9 \t",
        b"  hits k 2 @9\r",
        b"hits\tk\t2\t@9 \t\r",
    ] {
        assert_eq!(event(line), expected, "{:?}", String::from_utf8_lossy(line));
    }
    assert_eq!(event(b"hits k\r").key.as_str(), "k");
    // Only one trailing `\r` belongs to the line ending; another is part of the key.
    assert_eq!(reject(b"hits k\r\r"), Reject::BadKey);
    assert_eq!(reject(b"hits k 1\r\r"), Reject::BadDelta);
}

#[test]
fn empty_lines() {
    for line in [&b""[..], b" ", b"\t", b"\r", b" \t \r", b"\t\t\t"] {
        assert_eq!(parse(line), Ok(Line::Empty), "{line:?}");
    }
}

#[test]
fn control_lines() {
    assert_eq!(parse(b"!flush"), Ok(Line::Control(Control::Flush)));
    assert_eq!(parse(b"!ping"), Ok(Line::Control(Control::Ping)));
    assert_eq!(parse(b"!sync"), Ok(Line::Control(Control::Sync)));
    assert_eq!(parse(b"!errors"), Ok(Line::Control(Control::Errors)));
    assert_eq!(parse(b"!sync \t\r"), Ok(Line::Control(Control::Sync)));
    assert_eq!(parse(b"!ping\r"), Ok(Line::Control(Control::Ping)));
    assert_eq!(parse(b"  !flush"), Ok(Line::Control(Control::Flush)));
    for line in [
        &b"!FLUSH"[..],
        b"!flushx",
        b"!",
        b"! flush",
        b"!flush now",
        b"!x",
        b"!flush\r\r",
        b"!reload",
    ] {
        assert_eq!(
            reject(line),
            Reject::UnknownCommand,
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn unknown_counter() {
    assert_eq!(reject(b"nope k"), Reject::UnknownCounter);
    assert_eq!(reject(b"Hits k"), Reject::UnknownCounter);
    assert_eq!(reject(b"hit k"), Reject::UnknownCounter);
    assert_eq!(reject(b"hitss k"), Reject::UnknownCounter);
    assert_eq!(reject(b"\xff k"), Reject::UnknownCounter);
}

#[test]
fn line_too_long() {
    let limits = Limits {
        max_line_bytes: 10,
        max_key_bytes: 256,
    };
    let c = counters();
    assert!(matches!(
        parse_line(b"hits 12345", &c, &limits),
        Ok(Line::Event(_))
    ));
    assert_eq!(
        parse_line(b"hits 123456", &c, &limits),
        Err(Reject::TooLong)
    );
    // The `\r` of `\r\n` counts, as it does in the framer.
    assert_eq!(
        parse_line(b"hits 12345\r", &c, &limits),
        Err(Reject::TooLong)
    );
    assert_eq!(parse_line(&[b' '; 11], &c, &limits), Err(Reject::TooLong));
}

#[test]
fn key_too_long() {
    let limits = Limits {
        max_line_bytes: 4096,
        max_key_bytes: 8,
    };
    let c = counters();
    let key = |line: &'static [u8]| match parse_line(line, &c, &limits) {
        Ok(Line::Event(e)) => Ok(e.key.as_str().to_owned()),
        Ok(other) => panic!("{other:?}"),
        Err(r) => Err(r),
    };
    assert_eq!(key(b"hits 12345678"), Ok("12345678".into()));
    assert_eq!(key(b"hits 123456789"), Err(Reject::KeyTooLong));
    // Measured as sent, before canonicalisation.
    assert_eq!(key(b"users 00000001"), Ok("1".into()));
    assert_eq!(key(b"users 000000001"), Err(Reject::KeyTooLong));
    assert_eq!(
        key(b"docs 123e4567-e89b-12d3-a456-426614174000"),
        Err(Reject::KeyTooLong)
    );
    // Length is checked before content.
    assert_eq!(
        key(b"hits \xff\xff\xff\xff\xff\xff\xff\xff\xff"),
        Err(Reject::KeyTooLong)
    );
    // Default limit is 256.
    let long = format!("hits {}", "k".repeat(256));
    assert_eq!(key_of(&long).len(), 256);
    let too_long = format!("hits {}", "k".repeat(257));
    assert_eq!(reject(too_long.as_bytes()), Reject::KeyTooLong);
}

// ---- keys ----

#[test]
fn text_keys() {
    assert!(is_borrowed("hits /index.html?a=b"));
    assert_eq!(key_of("hits /index.html?a=b"), "/index.html?a=b");
    assert_eq!(key_of("hits ünïcødé→✓"), "ünïcødé→✓");
    assert_eq!(key_of("hits {Mixed-Case}"), "{Mixed-Case}");
    assert_eq!(key_of("hits @home"), "@home");
    assert_eq!(key_of("hits !bang"), "!bang");
    for line in [
        &b"hits a\x00b"[..],
        b"hits a\x01b",
        b"hits a\x1fb",
        b"hits a\x7fb",
        b"hits a\rb",
        b"hits a\nb",
        b"hits a\x0bb",
        b"hits a\x0cb",
        b"hits \xff",
        b"hits a\xc3",          // truncated sequence
        b"hits \xed\xa0\x80",   // surrogate
        b"hits a\xc2\xa0b",     // U+00A0 no-break space
        b"hits a\xe3\x80\x80b", // U+3000 ideographic space
        b"hits a\xc2\x85b",     // U+0085 next line
        b"hits a\xe2\x80\xa8b", // U+2028 line separator
    ] {
        assert_eq!(
            reject(line),
            Reject::BadKey,
            "{:?}",
            String::from_utf8_lossy(line)
        );
    }
}

#[test]
fn bigint_keys() {
    for (input, canonical, borrowed) in [
        ("0", "0", true),
        ("7", "7", true),
        ("-7", "-7", true),
        ("1234567890", "1234567890", true),
        ("+007", "7", false),
        ("+7", "7", false),
        ("007", "7", false),
        ("-0", "0", false),
        ("+0", "0", false),
        ("000", "0", false),
        ("-000123", "-123", false),
        ("9223372036854775807", "9223372036854775807", true),
        ("-9223372036854775808", "-9223372036854775808", true),
        ("+0009223372036854775807", "9223372036854775807", false),
        ("-0009223372036854775808", "-9223372036854775808", false),
    ] {
        let line = format!("users {input}");
        assert_eq!(key_of(&line), canonical, "{input}");
        assert_eq!(is_borrowed(&line), borrowed, "{input}");
        assert_eq!(event(line.as_bytes()).key, inline(canonical), "{input}");
    }
    for input in [
        &b"9223372036854775808"[..],
        b"-9223372036854775809",
        b"10000000000000000000",
        b"-",
        b"+",
        b"--1",
        b"+-1",
        b"1-",
        b"1a",
        b"0x1",
        b"1.0",
        b"1e3",
        b"\xef\xbc\x91",
        b"\xff",
    ] {
        let mut line = b"users ".to_vec();
        line.extend_from_slice(input);
        assert_eq!(
            reject(&line),
            Reject::BadKey,
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn uuid_keys() {
    let canonical = "123e4567-e89b-12d3-a456-426614174000";
    assert!(is_borrowed(&format!("docs {canonical}")));
    for input in [
        "123E4567-E89B-12D3-A456-426614174000",
        "123e4567e89b12d3a456426614174000",
        "123E4567E89B12D3A456426614174000",
        "{123e4567-e89b-12d3-a456-426614174000}",
        "{123E4567-e89b-12D3-a456-426614174000}",
        "{123e4567e89b12d3a456426614174000}",
    ] {
        let line = format!("docs {input}");
        assert_eq!(key_of(&line), canonical, "{input}");
        assert!(!is_borrowed(&line), "{input}");
    }
    assert_eq!(
        key_of("docs FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF"),
        "ffffffff-ffff-ffff-ffff-ffffffffffff"
    );
    for input in [
        "123e4567-e89b-12d3-a456-42661417400",   // 35
        "123e4567-e89b-12d3-a456-4266141740000", // 37
        "123e4567e89b12d3a45642661417400",       // 31
        "123e4567e89b12d3a4564266141740000",     // 33
        "123e4567e89b-12d3-a456-426614174000",   // some hyphens only
        "123e4567-e89b-12d3-a456426614174000-",  // hyphen misplaced
        "123e456-7e89b-12d3-a456-426614174000",
        "123e4567-e89b-12d3-a456-42661417400g",
        "{123e4567-e89b-12d3-a456-426614174000",
        "123e4567-e89b-12d3-a456-426614174000}",
        "{{123e4567e89b12d3a456426614174000}}",
        "(123e4567-e89b-12d3-a456-426614174000)",
        "urn:uuid:123e4567-e89b-12d3-a456-426614174000",
        "{}",
    ] {
        assert_eq!(
            reject(format!("docs {input}").as_bytes()),
            Reject::BadKey,
            "{input}"
        );
    }
    assert_eq!(
        reject(b"docs \xff23e4567-e89b-12d3-a456-426614174000"),
        Reject::BadKey
    );
}

#[test]
fn inet_keys() {
    for (input, canonical) in [
        ("192.168.0.1", "192.168.0.1"),
        ("0.0.0.0", "0.0.0.0"),
        ("2001:DB8::1", "2001:db8::1"),
        ("2001:db8:0:0:0:0:0:1", "2001:db8::1"),
        ("2001:0DB8:0000:0000:0000:0000:0000:0001", "2001:db8::1"),
        ("::", "::"),
        ("::1", "::1"),
        ("::ffff:192.168.0.1", "::ffff:192.168.0.1"),
        ("::FFFF:C0A8:1", "::ffff:192.168.0.1"),
        (
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ),
    ] {
        assert_eq!(key_of(&format!("ips {input}")), canonical, "{input}");
    }
    for input in [
        &b"10.0.0.0/8"[..],
        b"2001:db8::/32",
        b"256.0.0.1",
        b"1.2.3",
        b"fe80::1%eth0",
        b"[::1]",
        b"1.2.3.4:80",
        b"localhost",
        b"::g",
        b"\xff",
    ] {
        let mut line = b"ips ".to_vec();
        line.extend_from_slice(input);
        assert_eq!(
            reject(&line),
            Reject::BadKey,
            "{:?}",
            String::from_utf8_lossy(input)
        );
    }
}

#[test]
fn keys_compare_and_hash_by_content() {
    use std::collections::hash_map::DefaultHasher;
    let hash = |k: &Key<'_>| {
        let mut h = DefaultHasher::new();
        k.hash(&mut h);
        h.finish()
    };
    let borrowed = Key::Borrowed("2001:db8::1");
    let inlined = inline("2001:db8::1");
    assert_eq!(borrowed, inlined);
    assert_eq!(hash(&borrowed), hash(&inlined));
    assert_ne!(borrowed, Key::Borrowed("2001:db8::2"));
    assert_eq!(inlined.to_string(), "2001:db8::1");
    assert_eq!(format!("{inlined:?}"), "Inline(\"2001:db8::1\")");
}

#[test]
fn inline_key_refuses_to_overflow() {
    use std::fmt::Write;
    let mut k = InlineKey::new();
    assert!(k.write_str(&"a".repeat(INLINE_CAPACITY)).is_ok());
    assert!(k.write_str("b").is_err());
    assert_eq!(k.push_ascii(b"b"), Err(Reject::BadKey));
    assert_eq!(k.as_bytes().len(), INLINE_CAPACITY);
}

#[test]
fn reject_names_and_messages() {
    let names: Vec<&str> = Reject::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        names,
        [
            "unknown_counter",
            "missing_key",
            "bad_key",
            "key_too_long",
            "bad_delta",
            "bad_timestamp",
            "too_many_fields",
            "too_long",
            "unknown_command",
            "unterminated",
            "overflow",
            "unmapped_metric",
            "sampled",
            "unsupported_type",
            "bad_statsd_line",
            "expired",
            "missing_value",
            "bad_value",
            "value_too_long",
            "wrong_kind",
            "relative_gauge",
            "not_settable",
            "unnamed_window"
        ]
    );
    let messages: std::collections::HashSet<String> =
        Reject::ALL.iter().map(|r| r.to_string()).collect();
    assert_eq!(messages.len(), Reject::ALL.len());
    for m in &messages {
        assert!(
            !m.is_empty() && m.chars().next().unwrap().is_lowercase(),
            "{m}"
        );
    }
    assert_eq!(Reject::UnknownCounter.to_string(), "unknown counter");
}

#[test]
fn key_type_names() {
    let names: Vec<&str> = [KeyType::Text, KeyType::Bigint, KeyType::Uuid, KeyType::Inet]
        .iter()
        .map(|t| t.as_str())
        .collect();
    assert_eq!(names, ["text", "bigint", "uuid", "inet"]);
}

#[test]
fn counters_lookup_linear_and_hashed() {
    let c = counters();
    assert_eq!(c.len(), 4);
    assert!(!c.is_empty());
    assert_eq!(c.lookup(b"ips"), Some((IPS, KeyType::Inet)));
    assert_eq!(c.lookup(b"docs"), Some((DOCS, KeyType::Uuid)));
    assert_eq!(c.lookup(b"nope"), None);
    assert_eq!(c.name(USERS), "users");

    let names: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
    let many = Counters::new(names.iter().map(|n| (n.as_str(), KeyType::Bigint)));
    assert!(many.by_name.is_some());
    assert_eq!(many.len(), 20);
    for (i, n) in names.iter().enumerate() {
        assert_eq!(many.lookup(n.as_bytes()), Some((i as u16, KeyType::Bigint)));
        assert_eq!(many.name(i as u16), n);
    }
    assert_eq!(many.lookup(b"c20"), None);
    let line = b"c19 +5 2";
    assert_eq!(
        parse_line(line, &many, &Limits::default()),
        Ok(Line::Event(Event {
            counter: 19,
            key: inline("5"),
            delta: 2,
            value: None,
            at_ms: None
        }))
    );

    // Duplicates resolve to the first declaration either way.
    let dup = Counters::new([("a", KeyType::Text), ("a", KeyType::Bigint)]);
    assert_eq!(dup.lookup(b"a"), Some((0, KeyType::Text)));
    let mut decl: Vec<(&str, KeyType)> =
        names.iter().map(|n| (n.as_str(), KeyType::Text)).collect();
    decl.push(("c0", KeyType::Uuid));
    assert_eq!(Counters::new(decl).lookup(b"c0"), Some((0, KeyType::Text)));

    assert!(Counters::new([]).is_empty());
}

// ---- framing ----

/// What framing must produce, computed from the whole input at once.
fn reference_stream(input: &[u8], max: usize) -> Vec<Result<Vec<u8>, Reject>> {
    let mut out = Vec::new();
    let mut rest = input;
    while let Some(i) = memchr::memchr(b'\n', rest) {
        let line = &rest[..i];
        out.push(if line.len() > max {
            Err(Reject::TooLong)
        } else {
            Ok(line.to_vec())
        });
        rest = &rest[i + 1..];
    }
    if rest.len() > max {
        out.push(Err(Reject::TooLong));
    } else if rest.iter().any(|&b| !matches!(b, b' ' | b'\t' | b'\r')) {
        out.push(Err(Reject::Unterminated));
    }
    out
}

/// Feeds `input` in chunks of the given sizes (cycled), checking the capacity bound.
fn framed(
    input: &[u8],
    max: usize,
    read_size: usize,
    chunks: &[usize],
) -> Vec<Result<Vec<u8>, Reject>> {
    let mut lb = LineBuffer::new(max, read_size);
    let mut out = Vec::new();
    let mut rest = input;
    let mut sizes = chunks.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap()).clamp(1, read_size).min(rest.len());
        let buf = lb.read_buf();
        assert!(buf.capacity() - buf.len() >= read_size);
        buf.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        assert!(
            lb.buf.capacity() <= max + read_size,
            "capacity {}",
            lb.buf.capacity()
        );
        lb.drain_lines(|r| out.push(r.map(<[u8]>::to_vec)));
        assert!(lb.buf.len() <= max);
    }
    lb.finish(|r| out.push(r.map(<[u8]>::to_vec)));
    assert!(lb.buf.is_empty());
    out
}

const STREAM: &[u8] = b"hits a\nusers 7 2\r\n\n  \n!flush\nips ::1 @5\ndocs 123E4567E89B12D3A456426614174000\nhits last";

#[test]
fn split_at_every_position_matches_one_read() {
    let whole = framed(STREAM, 64, 4096, &[STREAM.len()]);
    assert_eq!(whole, reference_stream(STREAM, 64));
    assert_eq!(whole.len(), 8);
    assert_eq!(whole.last(), Some(&Err(Reject::Unterminated)));
    for at in 0..=STREAM.len() {
        let mut lb = LineBuffer::new(64, 4096);
        let mut out = Vec::new();
        for part in [&STREAM[..at], &STREAM[at..]] {
            lb.read_buf().extend_from_slice(part);
            lb.drain_lines(|r| out.push(r.map(<[u8]>::to_vec)));
        }
        lb.finish(|r| out.push(r.map(<[u8]>::to_vec)));
        assert_eq!(out, whole, "split at {at}");
    }
    assert_eq!(framed(STREAM, 64, 1, &[1]), whole);
}

#[test]
fn framed_lines_parse() {
    let mut lb = LineBuffer::new(4096, 4096);
    lb.read_buf().extend_from_slice(b"users +07 3\r\n!ping\r\n");
    let c = counters();
    let mut parsed = Vec::new();
    lb.drain_lines(|r| {
        let line = r.unwrap();
        parsed.push(match parse_line(line, &c, &Limits::default()).unwrap() {
            Line::Event(e) => format!("{} {} {}", c.name(e.counter), e.key, e.delta),
            other => format!("{other:?}"),
        });
    });
    assert_eq!(parsed, ["users 7 3", "Control(Ping)"]);
}

#[test]
fn huge_line_without_newline_is_reported_once_and_memory_stays_bounded() {
    const READ: usize = 64 * 1024;
    const MAX: usize = 4096;
    let chunk = vec![b'x'; READ];
    let mut lb = LineBuffer::new(MAX, READ);
    let mut out: Vec<Result<Vec<u8>, Reject>> = Vec::new();
    for _ in 0..(100 * 1024 * 1024 / READ) {
        lb.read_buf().extend_from_slice(&chunk);
        lb.drain_lines(|r| out.push(r.map(<[u8]>::to_vec)));
        assert!(
            lb.buf.capacity() <= MAX + READ,
            "capacity {}",
            lb.buf.capacity()
        );
    }
    assert_eq!(out, [Err(Reject::TooLong)]);
    lb.read_buf().extend_from_slice(b"xxx\nok 1\n");
    lb.drain_lines(|r| out.push(r.map(<[u8]>::to_vec)));
    lb.finish(|r| out.push(r.map(<[u8]>::to_vec)));
    assert_eq!(out, [Err(Reject::TooLong), Ok(b"ok 1".to_vec())]);
    assert!(lb.buf.capacity() < 2 * (MAX + READ));
}

#[test]
fn over_long_line_inside_one_read() {
    let mut input = vec![b'x'; 20];
    input.extend_from_slice(b"\nok 1\n");
    let expected = vec![Err(Reject::TooLong), Ok(b"ok 1".to_vec())];
    assert_eq!(framed(&input, 10, 4096, &[4096]), expected);
    assert_eq!(framed(&input, 10, 3, &[3]), expected);
    assert_eq!(framed(&input, 10, 1, &[1]), expected);
}

#[test]
fn line_length_boundary() {
    let mut input = vec![b'a'; 10];
    input.push(b'\n');
    input.extend_from_slice(&[b'b'; 11]);
    input.push(b'\n');
    for read in [1, 5, 10, 11, 12, 100] {
        assert_eq!(
            framed(&input, 10, read, &[read]),
            [Ok(vec![b'a'; 10]), Err(Reject::TooLong)],
            "read size {read}"
        );
    }
}

#[test]
fn drain_lines_while_holds_the_line_it_stops_at() {
    let mut lb = LineBuffer::new(16, 64);
    let mut out = Vec::new();
    lb.read_buf()
        .extend_from_slice(b"!ping\nhits a\n!sync\nhits");
    let held = lb.drain_lines_while(|r| {
        let line = r.unwrap().to_vec();
        let take = line.starts_with(b"!");
        if take {
            out.push(line);
        }
        take
    });
    assert!(held);
    assert_eq!(out, [b"!ping".to_vec()]);
    // The held line and everything after it come back, in order, with later bytes.
    lb.read_buf().extend_from_slice(b" b\n");
    let mut rest = Vec::new();
    assert!(!lb.drain_lines_while(|r| {
        rest.push(r.unwrap().to_vec());
        true
    }));
    assert_eq!(
        rest,
        [b"hits a".to_vec(), b"!sync".to_vec(), b"hits b".to_vec()]
    );
}

#[test]
fn finish_cases() {
    let run = |input: &[u8]| framed(input, 16, 64, &[64]);
    assert_eq!(
        run(b"hits a\nhits b"),
        [Ok(b"hits a".to_vec()), Err(Reject::Unterminated)]
    );
    assert_eq!(run(b"hits a\n \t\r"), [Ok(b"hits a".to_vec())]);
    assert_eq!(run(b""), []);
    // The tail of an already reported over-long line is not reported again.
    assert_eq!(run(&[b'x'; 40]), [Err(Reject::TooLong)]);

    // finish() drains complete lines the caller did not drain yet, and resets for reuse.
    let mut lb = LineBuffer::new(16, 64);
    let mut out = Vec::new();
    lb.read_buf().extend_from_slice(b"a\nb\nc");
    lb.finish(|r| out.push(r.map(<[u8]>::to_vec)));
    assert_eq!(
        out,
        [
            Ok(b"a".to_vec()),
            Ok(b"b".to_vec()),
            Err(Reject::Unterminated)
        ]
    );
    out.clear();
    lb.read_buf().extend_from_slice(b"d\n");
    lb.finish(|r| out.push(r.map(<[u8]>::to_vec)));
    assert_eq!(out, [Ok(b"d".to_vec())]);
}

#[test]
fn oversized_appends_are_given_back() {
    let mut lb = LineBuffer::new(16, 16);
    let mut n = 0;
    lb.read_buf().extend_from_slice(&b"a\n".repeat(1000));
    lb.drain_lines(|r| {
        assert_eq!(r, Ok(&b"a"[..]));
        n += 1;
    });
    assert_eq!(n, 1000);
    assert!(lb.buf.capacity() <= 2 * 32);
}

// ---- datagrams ----

fn datagram(input: &[u8], max: usize) -> Vec<Result<&[u8], Reject>> {
    let mut out = Vec::new();
    datagram_lines(input, max, |r| out.push(r));
    out
}

#[test]
fn datagrams() {
    assert_eq!(
        datagram(b"hits a\nhits b 2\r\nhits c", 64),
        [Ok(&b"hits a"[..]), Ok(b"hits b 2\r"), Ok(b"hits c")]
    );
    assert_eq!(
        datagram(b"hits a\nhits b\n", 64),
        [Ok(&b"hits a"[..]), Ok(b"hits b")]
    );
    assert_eq!(datagram(b"a\n\nb", 64), [Ok(&b"a"[..]), Ok(b""), Ok(b"b")]);
    assert_eq!(datagram(b"\n", 64), [Ok(&b""[..])]);
    assert_eq!(datagram(b"", 64), []);
    assert_eq!(
        datagram(b"0123456789\n01234567890\nok", 10),
        [Ok(&b"0123456789"[..]), Err(Reject::TooLong), Ok(b"ok")]
    );
    assert_eq!(
        datagram(b"ok\n01234567890", 10),
        [Ok(&b"ok"[..]), Err(Reject::TooLong)]
    );
}

// ---- properties ----

fn stream_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        prop_oneof![
            3 => Just(b'\n'),
            2 => Just(b' '),
            1 => Just(b'\r'),
            1 => Just(b'\t'),
            6 => b'a'..=b'z',
            2 => any::<u8>(),
        ],
        0..400,
    )
}

fn token() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"hits".to_vec()),
        Just(b"users".to_vec()),
        Just(b"docs".to_vec()),
        Just(b"ips".to_vec()),
        Just(b"!flush".to_vec()),
        Just(b"!ping".to_vec()),
        Just(b"@".to_vec()),
        Just(b"-".to_vec()),
        Just(b"+".to_vec()),
        Just(b"{}".to_vec()),
        "[+-]?[0-9]{1,25}".prop_map(String::into_bytes),
        "@[0-9]{1,20}".prop_map(String::into_bytes),
        "\\{?[0-9a-fA-F-]{30,38}\\}?".prop_map(String::into_bytes),
        "[0-9a-fA-F:.]{1,45}".prop_map(String::into_bytes),
        "\\PC{1,12}".prop_map(String::into_bytes),
        proptest::collection::vec(any::<u8>(), 1..12),
    ]
}

fn structured_line() -> impl Strategy<Value = Vec<u8>> {
    (
        proptest::collection::vec((token(), "[ \t]{1,3}"), 0..6),
        any::<bool>(),
    )
        .prop_map(|(parts, cr)| {
            let mut line = Vec::new();
            for (tok, sep) in parts {
                line.extend_from_slice(&tok);
                line.extend_from_slice(sep.as_bytes());
            }
            if cr {
                line.push(b'\r');
            }
            line
        })
}

/// Parsing must not panic, and a canonical key must parse to itself.
fn check_line(line: &[u8], limits: &Limits) {
    let c = counters();
    if let Ok(Line::Event(e)) = parse_line(line, &c, limits) {
        let canonical = e.key.as_bytes();
        assert!(!canonical.is_empty());
        let mut again = c.name(e.counter).as_bytes().to_vec();
        again.push(b' ');
        again.extend_from_slice(canonical);
        let big = Limits {
            max_line_bytes: usize::MAX,
            max_key_bytes: usize::MAX,
        };
        match parse_line(&again, &c, &big) {
            Ok(Line::Event(e2)) => {
                assert_eq!(e2.key, e.key);
                assert!(matches!(e2.key, Key::Borrowed(_)) || c.name(e.counter) == "ips");
            }
            other => panic!("canonical key {:?} reparsed as {other:?}", e.key),
        }
    }
}

proptest! {
    #[test]
    fn parse_line_never_panics(
        line in proptest::collection::vec(any::<u8>(), 0..300),
        max_line in 0usize..400,
        max_key in 0usize..300,
    ) {
        check_line(&line, &Limits::default());
        check_line(&line, &Limits { max_line_bytes: max_line, max_key_bytes: max_key });
    }

    #[test]
    fn parse_structured_lines(line in structured_line(), max_key in 1usize..60) {
        check_line(&line, &Limits::default());
        check_line(&line, &Limits { max_line_bytes: 4096, max_key_bytes: max_key });
    }

    #[test]
    fn line_buffer_matches_whole_input(
        input in stream_bytes(),
        chunks in proptest::collection::vec(1usize..64, 1..20),
        max in 0usize..40,
        read_size in 1usize..64,
    ) {
        prop_assert_eq!(framed(&input, max, read_size, &chunks), reference_stream(&input, max));
    }

    #[test]
    fn line_buffer_arbitrary_bytes(
        input in proptest::collection::vec(any::<u8>(), 0..600),
        chunks in proptest::collection::vec(1usize..200, 1..20),
    ) {
        prop_assert_eq!(framed(&input, 100, 200, &chunks), reference_stream(&input, 100));
    }

    #[test]
    fn datagram_lines_match_split(input in stream_bytes(), max in 0usize..40) {
        let mut expected: Vec<Result<&[u8], Reject>> = input
            .split(|&b| b == b'\n')
            .map(|l| if l.len() > max { Err(Reject::TooLong) } else { Ok(l) })
            .collect();
        // `split` yields an empty piece after a final `\n` (or for empty input); a datagram does not.
        if input.last().is_none_or(|&b| b == b'\n') {
            expected.pop();
        }
        prop_assert_eq!(datagram(&input, max), expected);
    }

    #[test]
    fn bigint_canonical_matches_i64(v in any::<i64>(), zeros in 0usize..5, plus in any::<bool>()) {
        let digits = v.unsigned_abs().to_string();
        let sign = if v < 0 { "-" } else if plus { "+" } else { "" };
        let line = format!("users {sign}{}{digits}", "0".repeat(zeros));
        prop_assert_eq!(key_of(&line), v.to_string());
    }

    #[test]
    fn uuid_canonical(bytes in any::<[u8; 16]>(), upper in any::<bool>(), hyphens in any::<bool>(), braces in any::<bool>()) {
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let canonical = format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]);
        let mut input = if hyphens { canonical.clone() } else { hex };
        if upper {
            input = input.to_uppercase();
        }
        if braces {
            input = format!("{{{input}}}");
        }
        prop_assert_eq!(key_of(&format!("docs {input}")), canonical);
    }

    #[test]
    fn inet_canonical(segments in any::<[u16; 8]>(), v4 in any::<[u8; 4]>()) {
        let v6 = std::net::Ipv6Addr::from(segments);
        let exploded: Vec<String> = segments.iter().map(|s| format!("{s:04X}")).collect();
        prop_assert_eq!(key_of(&format!("ips {}", exploded.join(":"))), v6.to_string());
        let v4 = std::net::Ipv4Addr::from(v4);
        prop_assert_eq!(key_of(&format!("ips {v4}")), v4.to_string());
        let mapped = v4.to_ipv6_mapped();
        prop_assert_eq!(key_of(&format!("ips ::ffff:{v4}")), mapped.to_string());
    }
}
