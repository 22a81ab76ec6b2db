//! The statsd / DogStatsD wire format: one line into its parts, without allocating.
//!
//! `<metric>:<value>[:<value>...]|<type>[|@<rate>][|#<tag>[:<value>],...][|T<unix_s>][|c:<id>][|e:<id>]`
//! (DogStatsD v1.1 multi-value packets, v1.3 timestamps; `c:` container ids and `e:` external
//! data are accepted and ignored). Events (`_e{...}`) and service checks (`_sc|...`) are
//! recognised so that they can be ignored. What a line means for tallyd is `mapping`'s job.

use crate::protocol::Reject;

/// What a statsd line is.
#[derive(Debug, PartialEq)]
pub enum Packet<'a> {
    Metric(Metric<'a>),
    /// A DogStatsD event, `_e{title_len,text_len}:...`.
    Event,
    /// A DogStatsD service check, `_sc|name|status...`.
    ServiceCheck,
    Empty,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    Counter,
    Gauge,
    Timer,
    Histogram,
    Distribution,
    Set,
}

/// One metric line, its fields still as sent.
#[derive(Debug, PartialEq)]
pub struct Metric<'a> {
    pub name: &'a [u8],
    /// One or more values separated by `:`.
    pub values: &'a [u8],
    pub kind: Type,
    /// The sample rate, if the line carried one (`@0.1`): in (0, 1].
    pub rate: Option<f64>,
    /// The tags as sent, `tag:value,tag2`; empty without tags.
    pub tags: &'a [u8],
    /// `T<unix seconds>`.
    pub timestamp_s: Option<u64>,
}

impl<'a> Metric<'a> {
    /// The value of tag `name` (`name:value`); a tag sent without a value has an empty one.
    pub fn tag(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.tags
            .split(|&b| b == b',')
            .find_map(|tag| match tag.iter().position(|&b| b == b':') {
                Some(i) if &tag[..i] == name => Some(&tag[i + 1..]),
                None if tag == name => Some(&tag[tag.len()..]),
                _ => None,
            })
    }

    pub fn values(&self) -> impl Iterator<Item = &'a [u8]> {
        self.values.split(|&b| b == b':')
    }
}

pub fn parse(line: &[u8]) -> Result<Packet<'_>, Reject> {
    let line = match line {
        [rest @ .., b'\r'] => rest,
        _ => line,
    };
    if line.iter().all(|&b| b == b' ' || b == b'\t') {
        return Ok(Packet::Empty);
    }
    if line.starts_with(b"_e{") {
        return Ok(Packet::Event);
    }
    if line.starts_with(b"_sc|") {
        return Ok(Packet::ServiceCheck);
    }
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or(Reject::BadStatsdLine)?;
    let (name, rest) = (&line[..colon], &line[colon + 1..]);
    if name.is_empty() || name.contains(&b'|') {
        return Err(Reject::BadStatsdLine);
    }
    let mut fields = rest.split(|&b| b == b'|');
    let values = fields.next().unwrap_or_default();
    let kind = match fields.next().ok_or(Reject::BadStatsdLine)? {
        b"c" => Type::Counter,
        b"g" => Type::Gauge,
        b"ms" => Type::Timer,
        b"h" => Type::Histogram,
        b"d" => Type::Distribution,
        b"s" => Type::Set,
        _ => return Err(Reject::BadStatsdLine),
    };
    if values.is_empty() {
        return Err(Reject::BadStatsdLine);
    }
    let mut metric = Metric {
        name,
        values,
        kind,
        rate: None,
        tags: b"",
        timestamp_s: None,
    };
    for field in fields {
        match field {
            [b'@', rate @ ..] => metric.rate = Some(parse_rate(rate)?),
            [b'#', tags @ ..] => metric.tags = tags,
            [b'T', ts @ ..] => {
                let ts = std::str::from_utf8(ts).map_err(|_| Reject::BadTimestamp)?;
                metric.timestamp_s = Some(ts.parse().map_err(|_| Reject::BadTimestamp)?);
            }
            [b'c' | b'e', b':', ..] => {}
            _ => return Err(Reject::BadStatsdLine),
        }
    }
    Ok(Packet::Metric(metric))
}

fn parse_rate(rate: &[u8]) -> Result<f64, Reject> {
    let rate: f64 = std::str::from_utf8(rate)
        .ok()
        .and_then(|r| r.parse().ok())
        .ok_or(Reject::BadStatsdLine)?;
    if rate > 0.0 && rate <= 1.0 {
        Ok(rate)
    } else {
        Err(Reject::BadStatsdLine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metric(line: &str) -> Metric<'_> {
        match parse(line.as_bytes()) {
            Ok(Packet::Metric(m)) => m,
            other => panic!("{line}: {other:?}"),
        }
    }

    #[test]
    fn plain_counter() {
        let m = metric("page.views:1|c");
        assert_eq!(m.name, b"page.views");
        assert_eq!(m.values().collect::<Vec<_>>(), [b"1"]);
        assert_eq!(m.kind, Type::Counter);
        assert_eq!((m.rate, m.tags, m.timestamp_s), (None, &b""[..], None));
    }

    #[test]
    fn dogstatsd_fields() {
        let m = metric("page.views:1:2:3|c|@0.5|#page:home,env:prod,solo|T1700000000|c:abc|e:x\r");
        assert_eq!(m.values().collect::<Vec<_>>(), [b"1", b"2", b"3"]);
        assert_eq!(m.rate, Some(0.5));
        assert_eq!(m.tag(b"page"), Some(&b"home"[..]));
        assert_eq!(m.tag(b"env"), Some(&b"prod"[..]));
        assert_eq!(m.tag(b"solo"), Some(&b""[..]));
        assert_eq!(m.tag(b"pag"), None);
        assert_eq!(m.timestamp_s, Some(1_700_000_000));
    }

    #[test]
    fn tag_values_may_hold_colons() {
        assert_eq!(
            metric("a:1|c|#url:http://x").tag(b"url"),
            Some(&b"http://x"[..])
        );
    }

    #[test]
    fn types() {
        for (t, k) in [
            ("g", Type::Gauge),
            ("ms", Type::Timer),
            ("h", Type::Histogram),
            ("d", Type::Distribution),
            ("s", Type::Set),
        ] {
            assert_eq!(metric(&format!("a:1|{t}")).kind, k);
        }
    }

    #[test]
    fn events_service_checks_and_empty() {
        assert_eq!(parse(b"_e{5,4}:title|text|#a:b"), Ok(Packet::Event));
        assert_eq!(parse(b"_sc|db.up|0|#a:b"), Ok(Packet::ServiceCheck));
        assert_eq!(parse(b""), Ok(Packet::Empty));
        assert_eq!(parse(b" \r"), Ok(Packet::Empty));
    }

    #[test]
    fn malformed() {
        for line in [
            "a",
            "a:1",
            "a:1|",
            "a:1|x",
            ":1|c",
            "a:|c",
            "a:1|c|@0",
            "a:1|c|@1.5",
            "a:1|c|@x",
            "a:1|c|zz",
            "hits a 1",
        ] {
            assert_eq!(parse(line.as_bytes()), Err(Reject::BadStatsdLine), "{line}");
        }
        assert_eq!(parse(b"a:1|c|Tx"), Err(Reject::BadTimestamp));
        assert_eq!(parse(b"a:1|c|T-1"), Err(Reject::BadTimestamp));
    }
}
