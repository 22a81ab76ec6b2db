//! RESP, Redis's wire protocol, as far as the `redis-daily` peer needs it: commands written as
//! arrays of bulk strings, replies read from a buffered stream. Written by hand rather than
//! with a client crate so the pipelined clients do nothing but copy bytes and count replies.

use std::io::BufRead;

use anyhow::{bail, ensure, Context, Result};

use crate::load::push_decimal;

/// One reply, as much of it as the mover reads.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    /// `None`: the null bulk string (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `None`: the null array (`*-1`).
    Array(Option<Vec<Reply>>),
}

/// Appends the command `args` (an array of bulk strings).
pub(crate) fn push_command(buf: &mut Vec<u8>, args: &[&[u8]]) {
    buf.push(b'*');
    push_decimal(buf, args.len() as u64);
    buf.extend_from_slice(b"\r\n");
    for arg in args {
        push_bulk(buf, arg);
    }
}

fn push_bulk(buf: &mut Vec<u8>, arg: &[u8]) {
    buf.push(b'$');
    push_decimal(buf, arg.len() as u64);
    buf.extend_from_slice(b"\r\n");
    buf.extend_from_slice(arg);
    buf.extend_from_slice(b"\r\n");
}

/// Appends `HINCRBY <key> <field> 1`, the field in decimal, without a formatter.
pub(crate) fn push_hincrby(buf: &mut Vec<u8>, key: &[u8], field: u64) {
    buf.extend_from_slice(b"*4\r\n$7\r\nHINCRBY\r\n");
    push_bulk(buf, key);
    buf.push(b'$');
    push_decimal(buf, u64::from(field.checked_ilog10().unwrap_or(0) + 1));
    buf.extend_from_slice(b"\r\n");
    push_decimal(buf, field);
    buf.extend_from_slice(b"\r\n$1\r\n1\r\n");
}

/// One line up to `\r\n` into `line`, without it; the end of the stream is an error.
fn read_line(r: &mut impl BufRead, line: &mut Vec<u8>) -> Result<()> {
    line.clear();
    let n = r.read_until(b'\n', line)?;
    ensure!(n > 0, "redis-server closed the connection");
    ensure!(
        line.ends_with(b"\r\n"),
        "redis-server sent a truncated line: {:?}",
        String::from_utf8_lossy(line)
    );
    line.truncate(line.len() - 2);
    Ok(())
}

fn parse_int(digits: &[u8]) -> Result<i64> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an integer: {:?}", String::from_utf8_lossy(digits)))
}

/// A bulk string's bytes (after its `$<len>` line) into `out`; `None` for the null bulk string.
fn read_bulk_body(r: &mut impl BufRead, len: i64, out: &mut Vec<u8>) -> Result<Option<()>> {
    if len < 0 {
        return Ok(None);
    }
    out.clear();
    out.resize(len as usize + 2, 0);
    r.read_exact(out)
        .context("redis-server closed the connection")?;
    ensure!(out.ends_with(b"\r\n"), "a bulk string without its \\r\\n");
    out.truncate(len as usize);
    Ok(Some(()))
}

/// One whole reply.
pub(crate) fn read_reply(r: &mut impl BufRead) -> Result<Reply> {
    let mut line = Vec::new();
    read_line(r, &mut line)?;
    let (kind, rest) = line
        .split_first()
        .context("redis-server sent an empty line")?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    Ok(match kind {
        b'+' => Reply::Status(text()),
        b'-' => Reply::Error(text()),
        b':' => Reply::Int(parse_int(rest)?),
        b'$' => {
            let mut body = Vec::new();
            Reply::Bulk(read_bulk_body(r, parse_int(rest)?, &mut body)?.map(|()| body))
        }
        b'*' => {
            let n = parse_int(rest)?;
            if n < 0 {
                Reply::Array(None)
            } else {
                let items: Result<Vec<Reply>> = (0..n).map(|_| read_reply(r)).collect();
                Reply::Array(Some(items?))
            }
        }
        _ => bail!("redis-server sent an unknown reply: {:?}", text()),
    })
}

/// `n` integer replies, as `HINCRBY`s answer; any other reply is an error naming it. `line` is
/// scratch space, kept by the caller so a pipeline allocates nothing per batch.
pub(crate) fn read_ints(r: &mut impl BufRead, n: usize, line: &mut Vec<u8>) -> Result<()> {
    for _ in 0..n {
        read_line(r, line)?;
        if line.first() != Some(&b':') {
            bail!(
                "redis-server answered {:?} where an integer was due",
                String::from_utf8_lossy(line)
            );
        }
    }
    Ok(())
}

/// The reply to `HGETALL` of a hash whose fields and values are integers: (field, value) pairs,
/// read without an allocation per element (a moved hash can hold a million fields).
pub(crate) fn read_int_pairs<R: BufRead>(r: &mut R) -> Result<Vec<(i64, i64)>> {
    let mut line = Vec::new();
    read_line(r, &mut line)?;
    let n = match line.split_first() {
        Some((b'*', n)) => parse_int(n)?,
        Some((b'-', err)) => bail!("HGETALL failed: {}", String::from_utf8_lossy(err)),
        _ => bail!("HGETALL answered {:?}", String::from_utf8_lossy(&line)),
    };
    ensure!(n >= 0 && n % 2 == 0, "HGETALL answered an array of {n}");
    let mut pairs = Vec::with_capacity(n as usize / 2);
    let mut body = Vec::new();
    let mut int = |r: &mut R| -> Result<i64> {
        read_line(r, &mut line)?;
        let len = match line.split_first() {
            Some((b'$', len)) => parse_int(len)?,
            _ => bail!("HGETALL answered {:?}", String::from_utf8_lossy(&line)),
        };
        read_bulk_body(r, len, &mut body)?.context("HGETALL answered a null string")?;
        parse_int(&body)
    };
    for _ in 0..n / 2 {
        let field = int(r)?;
        pairs.push((field, int(r)?));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut buf = Vec::new();
        push_command(&mut buf, &[b"RENAME", b"a", b"bc"]);
        assert_eq!(buf, b"*3\r\n$6\r\nRENAME\r\n$1\r\na\r\n$2\r\nbc\r\n");
        buf.clear();
        push_hincrby(&mut buf, b"downloads:2024-02-29", 1234);
        let mut expected = Vec::new();
        push_command(
            &mut expected,
            &[b"HINCRBY", b"downloads:2024-02-29", b"1234", b"1"],
        );
        assert_eq!(buf, expected);
        buf.clear();
        push_hincrby(&mut buf, b"k", 0);
        assert!(buf.ends_with(b"$1\r\n0\r\n$1\r\n1\r\n"));
    }

    #[test]
    fn replies_are_read_whole() {
        let mut r: &[u8] =
            b"+OK\r\n-ERR no such key\r\n:42\r\n$3\r\na\r\n\r\n$-1\r\n*2\r\n:1\r\n*-1\r\n";
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Status("OK".into()));
        assert_eq!(
            read_reply(&mut r).unwrap(),
            Reply::Error("ERR no such key".into())
        );
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Int(42));
        assert_eq!(
            read_reply(&mut r).unwrap(),
            Reply::Bulk(Some(b"a\r\n".to_vec()))
        );
        assert_eq!(read_reply(&mut r).unwrap(), Reply::Bulk(None));
        assert_eq!(
            read_reply(&mut r).unwrap(),
            Reply::Array(Some(vec![Reply::Int(1), Reply::Array(None)]))
        );
        assert_eq!(
            read_reply(&mut r).unwrap_err().to_string(),
            "redis-server closed the connection"
        );
    }

    #[test]
    fn pipelined_integers_and_hash_pairs() {
        let mut line = Vec::new();
        let mut r: &[u8] = b":1\r\n:7\r\n-WRONGTYPE x\r\n";
        read_ints(&mut r, 2, &mut line).unwrap();
        let err = read_ints(&mut r, 1, &mut line).unwrap_err();
        assert_eq!(
            err.to_string(),
            "redis-server answered \"-WRONGTYPE x\" where an integer was due"
        );
        let mut r: &[u8] = b"*4\r\n$2\r\n17\r\n$1\r\n3\r\n$1\r\n0\r\n$3\r\n120\r\n";
        assert_eq!(read_int_pairs(&mut r).unwrap(), vec![(17, 3), (0, 120)]);
        let mut r: &[u8] = b"*0\r\n";
        assert!(read_int_pairs(&mut r).unwrap().is_empty());
    }
}
