//! Key types and canonical keys: validating a key as sent and rewriting it into the one form
//! PostgreSQL stores (bigint without leading zeros, lower-case UUID, canonical inet), without
//! touching the heap.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

use super::reject::Reject;

/// How a counter's keys are validated and canonicalised; also `counters[].key_type` in
/// config.toml (lowercase there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyType {
    Text,
    Bigint,
    Uuid,
    Inet,
}

impl KeyType {
    pub fn as_str(self) -> &'static str {
        match self {
            KeyType::Text => "text",
            KeyType::Bigint => "bigint",
            KeyType::Uuid => "uuid",
            KeyType::Inet => "inet",
        }
    }
}

/// A canonical key: borrowed from the line when it is already canonical, otherwise held inline
/// on the stack.
///
/// Equality and hashing go by content, so a borrowed and an inline key with the same text are
/// the same key.
#[derive(Clone, Copy, Debug)]
pub enum Key<'a> {
    Borrowed(&'a str),
    Inline(InlineKey),
}

impl Key<'_> {
    pub fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(s) => s,
            Key::Inline(k) => k.as_str(),
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Borrowed(s) => s.as_bytes(),
            Key::Inline(k) => k.as_bytes(),
        }
    }
}

impl PartialEq for Key<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key<'_> {}

impl Hash for Key<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Display for Key<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

/// Room for the longest canonical key that is not borrowed: an IPv6 address with an embedded
/// IPv4 address is at most 45 bytes.
pub(super) const INLINE_CAPACITY: usize = 48;

/// A short canonical key stored without touching the heap.
#[derive(Clone, Copy)]
pub struct InlineKey {
    len: u8,
    bytes: [u8; INLINE_CAPACITY],
}

impl InlineKey {
    pub(super) fn new() -> InlineKey {
        InlineKey {
            len: 0,
            bytes: [0; INLINE_CAPACITY],
        }
    }

    /// Only for ASCII, which keeps the contents valid UTF-8 whatever the byte boundaries.
    pub(super) fn push_ascii(&mut self, s: &[u8]) -> Result<(), Reject> {
        debug_assert!(s.is_ascii());
        let start = usize::from(self.len);
        let end = start + s.len();
        if end > INLINE_CAPACITY {
            return Err(Reject::BadKey);
        }
        self.bytes[start..end].copy_from_slice(s);
        self.len = end as u8;
        Ok(())
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    pub fn as_str(&self) -> &str {
        // Only whole `&str`s and ASCII are ever appended, so this cannot fail.
        std::str::from_utf8(self.as_bytes()).expect("InlineKey holds valid UTF-8")
    }
}

impl fmt::Write for InlineKey {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let start = usize::from(self.len);
        let end = start + s.len();
        if end > INLINE_CAPACITY {
            return Err(fmt::Error);
        }
        self.bytes[start..end].copy_from_slice(s.as_bytes());
        self.len = end as u8;
        Ok(())
    }
}

impl fmt::Debug for InlineKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq for InlineKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for InlineKey {}

impl Hash for InlineKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

pub(crate) fn parse_key(key: &[u8], key_type: KeyType) -> Result<Key<'_>, Reject> {
    match key_type {
        KeyType::Text => text_key(key).map(Key::Borrowed),
        KeyType::Bigint => bigint_key(key),
        KeyType::Uuid => uuid_key(key),
        KeyType::Inet => inet_key(key),
    }
}

pub(crate) fn text_key(key: &[u8]) -> Result<&str, Reject> {
    // Branch-free accumulation so the loop vectorises; keys are short and usually ASCII.
    let mut control = false;
    let mut high = 0u8;
    for &b in key {
        control |= (b < 0x20) | (b == 0x7f);
        high |= b;
    }
    if control {
        return Err(Reject::BadKey);
    }
    let s = std::str::from_utf8(key).map_err(|_| Reject::BadKey)?;
    if high >= 0x80 && s.chars().any(char::is_whitespace) {
        return Err(Reject::BadKey);
    }
    Ok(s)
}

/// Borrows a key that is pure ASCII (already checked by the caller's grammar).
fn ascii_str(key: &[u8]) -> Result<&str, Reject> {
    std::str::from_utf8(key).map_err(|_| Reject::BadKey)
}

fn bigint_key(key: &[u8]) -> Result<Key<'_>, Reject> {
    let (negative, plus, digits) = match key {
        [b'-', rest @ ..] => (true, false, rest),
        [b'+', rest @ ..] => (false, true, rest),
        _ => (false, false, key),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(Reject::BadKey);
    }
    let zeros = digits
        .iter()
        .position(|&b| b != b'0')
        .unwrap_or(digits.len());
    let significant = &digits[zeros..];
    // Same-length digit strings compare like the numbers they spell.
    let limit: &[u8] = if negative {
        b"9223372036854775808"
    } else {
        b"9223372036854775807"
    };
    if significant.len() > limit.len() || (significant.len() == limit.len() && significant > limit)
    {
        return Err(Reject::BadKey);
    }
    if significant.is_empty() {
        return if key == b"0" {
            Ok(Key::Borrowed("0"))
        } else {
            let mut inline = InlineKey::new();
            inline.push_ascii(b"0")?;
            Ok(Key::Inline(inline))
        };
    }
    if zeros == 0 && !plus {
        return ascii_str(key).map(Key::Borrowed);
    }
    let mut inline = InlineKey::new();
    if negative {
        inline.push_ascii(b"-")?;
    }
    inline.push_ascii(significant)?;
    Ok(Key::Inline(inline))
}

fn uuid_key(key: &[u8]) -> Result<Key<'_>, Reject> {
    let inner = match key {
        [b'{', inner @ .., b'}'] => inner,
        _ => key,
    };
    let hyphenated = match inner.len() {
        36 => true,
        32 => false,
        _ => return Err(Reject::BadKey),
    };
    let mut out = InlineKey::new();
    let mut o = 0;
    let mut lowercase = true;
    for (i, &b) in inner.iter().enumerate() {
        let hyphen_here = matches!(i, 8 | 13 | 18 | 23);
        if hyphenated && hyphen_here {
            if b != b'-' {
                return Err(Reject::BadKey);
            }
            out.bytes[o] = b'-';
            o += 1;
            continue;
        }
        let lower = match b {
            b'0'..=b'9' | b'a'..=b'f' => b,
            b'A'..=b'F' => {
                lowercase = false;
                b | 0x20
            }
            _ => return Err(Reject::BadKey),
        };
        if !hyphenated && matches!(o, 8 | 13 | 18 | 23) {
            out.bytes[o] = b'-';
            o += 1;
        }
        out.bytes[o] = lower;
        o += 1;
    }
    debug_assert_eq!(o, 36);
    if hyphenated && lowercase && inner.len() == key.len() {
        return ascii_str(key).map(Key::Borrowed);
    }
    out.len = 36;
    Ok(Key::Inline(out))
}

fn inet_key(key: &[u8]) -> Result<Key<'_>, Reject> {
    use std::fmt::Write;
    let s = std::str::from_utf8(key).map_err(|_| Reject::BadKey)?;
    let addr: IpAddr = s.parse().map_err(|_| Reject::BadKey)?;
    let mut out = InlineKey::new();
    write!(out, "{addr}").map_err(|_| Reject::BadKey)?;
    Ok(Key::Inline(out))
}
