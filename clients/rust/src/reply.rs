//! tallyd's reply lines, parsed: answers to control lines, `rejected` lines after `!errors`,
//! and the lines it sends before closing a connection.

/// One rejected line, as tallyd reported it after `!errors`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The line's number: on the connection for events outside a batch, within the batch
    /// (from 1) for a batch's lines; `None` for `overflow` found after the line left the
    /// connection.
    pub line: Option<u64>,
    /// One of the protocol's rejection reasons (`unknown_counter`, `bad_key`, ...).
    pub reason: String,
    /// The first 64 bytes of the line, escaped as tallyd sent it (without the quotes).
    pub excerpt: String,
}

/// One reply line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `ok`: `!errors`, `!sync`, a correction, `!batch`, `!abort`.
    Ok,
    /// `ok <accepted> <rejected>`: `!flush`, `!commit`.
    Counts { accepted: u64, rejected: u64 },
    /// `pong`.
    Pong,
    /// `duplicate`: a `!commit` whose id was already committed.
    Duplicate,
    /// `rejected <line> <reason> "<excerpt>"`.
    Rejected(Rejection),
    /// `error <reason> <message>`.
    Error { reason: String, message: String },
    /// A line tallyd sends before it closes the connection (idle, or too many connections).
    Closing(String),
}

impl Reply {
    /// Parses one line (without its `\n`); `None` for a line the protocol does not have.
    pub fn parse(line: &str) -> Option<Reply> {
        let line = line.strip_suffix('\n').unwrap_or(line);
        match line {
            "ok" => return Some(Reply::Ok),
            "pong" => return Some(Reply::Pong),
            "duplicate" => return Some(Reply::Duplicate),
            _ => {}
        }
        if let Some(rest) = line.strip_prefix("ok ") {
            let (a, r) = rest.split_once(' ')?;
            return Some(Reply::Counts {
                accepted: a.parse().ok()?,
                rejected: r.parse().ok()?,
            });
        }
        if let Some(rest) = line.strip_prefix("rejected ") {
            return rejected(rest).map(Reply::Rejected);
        }
        let rest = line.strip_prefix("error ")?;
        // The lines of a closing connection, and `!sync`'s journal error, predate the
        // `error <reason> <message>` form.
        if rest.starts_with("idle") || rest == "too many connections" {
            return Some(Reply::Closing(rest.to_string()));
        }
        if let Some(cause) = rest.strip_prefix("journal write failed: ") {
            return Some(Reply::Error {
                reason: "journal_write_failed".into(),
                message: cause.to_string(),
            });
        }
        let (reason, message) = rest.split_once(' ').unwrap_or((rest, ""));
        Some(Reply::Error {
            reason: reason.to_string(),
            message: message.to_string(),
        })
    }
}

/// `<line> <reason> "<excerpt>"[...]`.
fn rejected(rest: &str) -> Option<Rejection> {
    let (line, rest) = rest.split_once(' ')?;
    let (reason, excerpt) = rest.split_once(' ')?;
    let line = match line {
        "-" => None,
        n => Some(n.parse().ok()?),
    };
    let excerpt = excerpt.strip_suffix("...").unwrap_or(excerpt);
    let excerpt = excerpt.strip_prefix('"')?.strip_suffix('"')?;
    Some(Rejection {
        line,
        reason: reason.to_string(),
        excerpt: excerpt.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reply() {
        let p = |s| Reply::parse(s).unwrap();
        assert_eq!(p("ok\n"), Reply::Ok);
        assert_eq!(
            p("ok 3 1"),
            Reply::Counts {
                accepted: 3,
                rejected: 1
            }
        );
        assert_eq!(p("pong"), Reply::Pong);
        assert_eq!(p("duplicate"), Reply::Duplicate);
        assert_eq!(
            p(r#"rejected 3 unknown_counter "nope \"k\"""#),
            Reply::Rejected(Rejection {
                line: Some(3),
                reason: "unknown_counter".into(),
                excerpt: r#"nope \"k\""#.into()
            })
        );
        assert_eq!(
            p(r#"rejected - overflow """#),
            Reply::Rejected(Rejection {
                line: None,
                reason: "overflow".into(),
                excerpt: String::new()
            })
        );
        assert!(matches!(p(r#"rejected 9 too_many_fields "aaaa"..."#),
            Reply::Rejected(r) if r.excerpt == "aaaa"));
        assert_eq!(
            p("error not_settable this counter's total cannot be set"),
            Reply::Error {
                reason: "not_settable".into(),
                message: "this counter's total cannot be set".into()
            }
        );
        assert_eq!(
            p("error journal write failed: No space left on device"),
            Reply::Error {
                reason: "journal_write_failed".into(),
                message: "No space left on device".into()
            }
        );
        for closing in [
            "error idle for listen.idle_timeout_ms; closing",
            "error idle, closed to admit a new connection at listen.max_connections",
            "error too many connections",
        ] {
            assert_eq!(p(closing), Reply::Closing(closing[6..].into()));
        }
        for bad in [
            "ok x 1",
            "okay",
            "rejected 1 r noquote",
            "rejected x r \"\"",
        ] {
            assert_eq!(Reply::parse(bad), None, "{bad}");
        }
    }
}
