//! The lines the client writes: events of every kind, corrections and batch ids, checked only
//! for what would change their meaning on the wire (tallyd checks the rest and says why).

use std::fmt::Write as _;

use crate::error::Error;

/// The value in an event's third field: a sum counter's delta or a max, min or last counter's
/// value (`Int`), or a unique counter's value (`Text`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Int(i64),
    Text(String),
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::Int(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.to_string())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Text(v)
    }
}

/// One event line: `<counter> <key> [<value>] [@<unix_ms>]`.
///
/// ```
/// use tallyd_client::Event;
/// assert_eq!(Event::new("downloads", "report.pdf").line().unwrap(), "downloads report.pdf\n");
/// assert_eq!(Event::new("page_views", "42").delta(-1).at(1_700_000_000_000).line().unwrap(),
///            "page_views 42 -1 @1700000000000\n");
/// assert_eq!(Event::new("page_uniques", "/pricing").value("visitor-42").line().unwrap(),
///            "page_uniques /pricing visitor-42\n");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    counter: String,
    key: String,
    value: Option<Value>,
    at: Option<u64>,
}

impl Event {
    /// An event of a sum counter, delta 1 (the protocol's default), at the time tallyd reads
    /// it.
    pub fn new(counter: impl Into<String>, key: impl Into<String>) -> Event {
        Event {
            counter: counter.into(),
            key: key.into(),
            value: None,
            at: None,
        }
    }

    /// A sum counter's delta (may be negative or 0).
    pub fn delta(self, delta: i64) -> Event {
        self.value(delta)
    }

    /// The value of a unique (text), max, min or last (integer) counter's event.
    pub fn value(mut self, value: impl Into<Value>) -> Event {
        self.value = Some(value.into());
        self
    }

    /// The event time, in milliseconds since the Unix epoch (`@<unix_ms>`). Send it when you
    /// retry: without it the time is when tallyd reads the retry.
    pub fn at(mut self, unix_ms: u64) -> Event {
        self.at = Some(unix_ms);
        self
    }

    /// The line, with its `\n`.
    pub fn line(&self) -> Result<String, Error> {
        let mut out = String::new();
        self.write_line(&mut out)?;
        Ok(out)
    }

    /// Appends the line, with its `\n`, to `out`; refuses fields that would change its
    /// meaning (empty, or holding a separator or line break; a counter starting with `!`).
    pub fn write_line(&self, out: &mut String) -> Result<(), Error> {
        counter_field(&self.counter)?;
        field("key", &self.key)?;
        out.push_str(&self.counter);
        out.push(' ');
        out.push_str(&self.key);
        match &self.value {
            None => {}
            Some(Value::Int(v)) => {
                let _ = write!(out, " {v}");
            }
            Some(Value::Text(v)) => {
                field("value", v)?;
                out.push(' ');
                out.push_str(v);
            }
        }
        if let Some(at) = self.at {
            let _ = write!(out, " @{at}");
        }
        out.push('\n');
        Ok(())
    }
}

/// A field must be one field: not empty, without the separators (space, tab) or line breaks.
fn field(name: &'static str, value: &str) -> Result<(), Error> {
    let why = if value.is_empty() {
        "it is empty"
    } else if value.contains([' ', '\t']) {
        "it holds a space or tab, which separate fields"
    } else if value.contains(['\n', '\r']) {
        "it holds a line break"
    } else {
        return Ok(());
    };
    Err(Error::Invalid {
        field: name,
        value: value.to_string(),
        why,
    })
}

fn counter_field(counter: &str) -> Result<(), Error> {
    field("counter", counter)?;
    if counter.starts_with('!') {
        return Err(Error::Invalid {
            field: "counter",
            value: counter.to_string(),
            why: "a first field starting with `!` is a control line",
        });
    }
    Ok(())
}

/// `!set <counter> <key> <value> [@<unix_ms>]`.
pub(crate) fn set_line(
    counter: &str,
    key: &str,
    value: i64,
    at: Option<u64>,
) -> Result<String, Error> {
    counter_field(counter)?;
    field("key", key)?;
    let mut line = format!("!set {counter} {key} {value}");
    if let Some(at) = at {
        let _ = write!(line, " @{at}");
    }
    line.push('\n');
    Ok(line)
}

/// `!forget <counter> <key>`, or `!forget * <key>` for every counter.
pub(crate) fn forget_line(counter: Option<&str>, key: &str) -> Result<String, Error> {
    if let Some(counter) = counter {
        counter_field(counter)?;
    }
    field("key", key)?;
    Ok(format!("!forget {} {key}\n", counter.unwrap_or("*")))
}

/// The longest batch id tallyd takes (`listen.max_key_bytes` by default); a longer one is
/// refused before it is sent.
pub const MAX_BATCH_ID_BYTES: usize = 256;

/// `!batch <id>`: the id is 1 to 256 bytes of text valid as a `text` key (no control
/// characters, no Unicode whitespace).
pub(crate) fn batch_line(id: &str) -> Result<String, Error> {
    let invalid = |why| {
        Err(Error::Invalid {
            field: "batch id",
            value: id.to_string(),
            why,
        })
    };
    if id.is_empty() {
        return invalid("it is empty");
    }
    if id.len() > MAX_BATCH_ID_BYTES {
        return invalid("it is longer than 256 bytes");
    }
    if id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return invalid("it holds a control character or whitespace");
    }
    Ok(format!("!batch {id}\n"))
}

/// A raw line from the caller: one line, not a control line (its reply would not be
/// awaited). The `\n` is added when missing.
pub(crate) fn raw_line(line: &str) -> Result<String, Error> {
    let body = line.strip_suffix('\n').unwrap_or(line);
    let invalid = |why| {
        Err(Error::Invalid {
            field: "line",
            value: line.to_string(),
            why,
        })
    };
    if body.contains('\n') {
        return invalid("it holds more than one line");
    }
    if body.trim_start_matches([' ', '\t']).starts_with('!') {
        return invalid("control lines are sent by the client's own methods");
    }
    Ok(format!("{body}\n"))
}

/// How many lines `bytes` (whole lines, each ending in `\n`) holds; refuses a missing final
/// `\n` and control lines.
pub(crate) fn count_lines(bytes: &[u8]) -> Result<u64, Error> {
    let invalid = |why| {
        Err(Error::Invalid {
            field: "lines",
            value: String::from_utf8_lossy(&bytes[..bytes.len().min(64)]).into_owned(),
            why,
        })
    };
    if bytes.last().is_some_and(|&b| b != b'\n') {
        return invalid("they do not end with a line break");
    }
    // A line starts at the buffer's start and after each `\n` but the last.
    let starts = std::iter::once(0).chain(memchr::memchr_iter(b'\n', bytes).map(|i| i + 1));
    let mut lines = 0;
    for start in starts {
        let first = bytes[start..].iter().find(|&&b| b != b' ' && b != b'\t');
        if first == Some(&b'!') {
            return invalid("control lines are sent by the client's own methods");
        }
        lines += 1;
    }
    // The position after the final `\n` starts no line.
    lines -= 1;
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_every_kind() {
        let line = |e: Event| e.line().unwrap();
        assert_eq!(line(Event::new("d", "k")), "d k\n");
        assert_eq!(line(Event::new("d", "k").delta(5).at(7)), "d k 5 @7\n");
        assert_eq!(line(Event::new("u", "k").value("@anna")), "u k @anna\n");
        assert_eq!(line(Event::new("m", "k").value(-3).at(1)), "m k -3 @1\n");
    }

    #[test]
    fn refuses_what_would_change_the_line() {
        for e in [
            Event::new("d", "a b"),
            Event::new("d", ""),
            Event::new("d", "a\nb"),
            Event::new("!flush", "k"),
            Event::new("d", "k").value("x\ty"),
        ] {
            assert!(matches!(e.line(), Err(Error::Invalid { .. })), "{e:?}");
        }
    }

    #[test]
    fn corrections_and_batch_ids() {
        assert_eq!(set_line("d", "k", -4, Some(9)).unwrap(), "!set d k -4 @9\n");
        assert_eq!(forget_line(None, "k").unwrap(), "!forget * k\n");
        assert_eq!(
            batch_line("importer:a.log:0").unwrap(),
            "!batch importer:a.log:0\n"
        );
        assert!(batch_line(&"x".repeat(257)).is_err());
        assert!(batch_line("a\u{a0}b").is_err());
        assert!(batch_line("").is_err());
    }

    #[test]
    fn raw_lines() {
        assert_eq!(raw_line("d k 1").unwrap(), "d k 1\n");
        assert!(raw_line("!flush").is_err());
        assert!(raw_line("a\nb").is_err());
        assert_eq!(count_lines(b"a b\nc d\n").unwrap(), 2);
        assert!(count_lines(b"a b\n!flush\n").is_err());
        assert!(count_lines(b"a b\n \t!flush\n").is_err());
        assert_eq!(count_lines(b"").unwrap(), 0);
        assert!(count_lines(b"a b").is_err());
    }
}
