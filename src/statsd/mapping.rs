//! From statsd metric names and tags to tallyd's (counter, key): each counter declares the metric
//! it takes (`[counters.statsd]`), and a statsd line becomes the same [`Event`]s a native line
//! would, or is rejected whole.
//!
//! Rules:
//! - `metric` is a metric name, or a pattern with one `*` (`views.*`). With `key_tag`, the key
//!   is that tag's value; without it, the key is the part of the name the `*` matched.
//! - A metric may map to several counters (one event each); a line is accepted for all of them
//!   or rejected for all, so one line is never half counted.
//! - The key is checked and canonicalised by the counter's key type, as on a native line.
//! - Counter lines (`|c`) go to `sum` counters, gauges (`|g`) to `last` counters and sets
//!   (`|s`) to `unique` counters; any other pairing is rejected (`wrong_kind`), and timers,
//!   histograms and distributions are not taken (`unsupported_type`). A counter's or a
//!   gauge's value must be a 64-bit integer; a relative gauge (`+3|g`, `-3|g`) is rejected
//!   (`relative_gauge`): a `last` value is the latest by event time, and a change relative to
//!   a value tallyd may not hold in memory cannot be made exact. A set's value is text, as a
//!   unique counter's value on a native line. `|T<unix_s>` is the event time; multi-value
//!   lines give one event per value.
//! - A sample rate below 1 is rejected (`sampled`) unless every counter the metric maps to sets
//!   `sampled = "scale"`: each value is then divided by the rate and rounded (approximate).

use std::collections::HashMap;

use super::parse::{self, Metric, Packet, Type};
use smallvec::SmallVec;

use crate::config::{CounterStatsd, Sampled};
use crate::kind::Kind;
use crate::protocol::{self, Event, KeyType, Limits, Reject, MAX_TIMESTAMP_MS};

/// The events of one statsd line, on the stack: a line maps to a few counters (and a
/// multi-value line to a few values each), so the statsd path allocates nothing per line.
pub(crate) type LineEvents<'a> = SmallVec<[Event<'a>; 4]>;

/// A metric pattern's name before and after its `*`.
type Pattern = (Box<[u8]>, Box<[u8]>);

/// How one counter takes statsd lines.
#[derive(Debug)]
struct Mapping {
    counter: u16,
    key_type: KeyType,
    /// The counter's kind: which statsd type it takes.
    kind: Kind,
    /// Name before and after the `*`; `None` for an exact name.
    pattern: Option<Pattern>,
    key_tag: Option<Box<[u8]>>,
    scale: bool,
}

impl Mapping {
    /// The key as sent, if `metric` is this mapping's.
    fn key<'a>(&self, metric: &Metric<'a>) -> Result<&'a [u8], Reject> {
        match (&self.key_tag, &self.pattern) {
            (Some(tag), _) => metric.tag(tag).ok_or(Reject::MissingKey),
            (None, Some((pre, suf))) => Ok(&metric.name[pre.len()..metric.name.len() - suf.len()]),
            (None, None) => Err(Reject::MissingKey),
        }
    }
}

/// Every counter's mapping, looked up by metric name.
#[derive(Debug, Default)]
pub struct Mappings {
    all: Vec<Mapping>,
    exact: HashMap<Box<[u8]>, Vec<usize>>,
    patterns: Vec<usize>,
}

/// What became of one statsd line that was not rejected.
#[derive(Debug, PartialEq, Eq)]
pub enum Taken {
    /// This many events, now in the caller's vector.
    Events(usize),
    Event,
    ServiceCheck,
    Empty,
}

impl Mappings {
    /// `decl`: (counter index, key type, kind, mapping) for each counter that has one.
    pub fn new<'a>(
        decl: impl IntoIterator<Item = (u16, KeyType, Kind, &'a CounterStatsd)>,
    ) -> Mappings {
        let mut m = Mappings::default();
        for (counter, key_type, kind, s) in decl {
            let pattern = s
                .metric
                .split_once('*')
                .map(|(pre, suf)| (Box::from(pre.as_bytes()), Box::from(suf.as_bytes())));
            let index = m.all.len();
            if pattern.is_some() {
                m.patterns.push(index);
            } else {
                m.exact
                    .entry(Box::from(s.metric.as_bytes()))
                    .or_default()
                    .push(index);
            }
            m.all.push(Mapping {
                counter,
                key_type,
                kind,
                pattern,
                key_tag: s.key_tag.as_ref().map(|t| Box::from(t.as_bytes())),
                scale: s.sampled == Sampled::Scale,
            });
        }
        m
    }

    pub fn is_empty(&self) -> bool {
        self.all.is_empty()
    }

    fn matching<'s>(&'s self, name: &'s [u8]) -> impl Iterator<Item = &'s Mapping> + 's {
        let exact = self.exact.get(name).into_iter().flatten();
        let patterns = self.patterns.iter().filter(move |&&i| {
            let (pre, suf) = self.all[i].pattern.as_ref().expect("patterns have one");
            name.len() > pre.len() + suf.len() && name.starts_with(pre) && name.ends_with(suf)
        });
        exact.chain(patterns).map(|&i| &self.all[i])
    }

    /// Turns one statsd line into events appended to `out` (nothing is appended when it is
    /// rejected).
    pub fn events<'a>(
        &self,
        line: &'a [u8],
        limits: &Limits,
        out: &mut LineEvents<'a>,
    ) -> Result<Taken, Reject> {
        if line.len() > limits.max_line_bytes {
            return Err(Reject::TooLong);
        }
        let metric = match parse::parse(line)? {
            Packet::Metric(m) => m,
            Packet::Event => return Ok(Taken::Event),
            Packet::ServiceCheck => return Ok(Taken::ServiceCheck),
            Packet::Empty => return Ok(Taken::Empty),
        };
        if !matches!(metric.kind, Type::Counter | Type::Gauge | Type::Set) {
            return Err(Reject::UnsupportedType);
        }
        let start = out.len();
        let result = self.push_events(&metric, limits, out);
        if result.is_err() {
            out.truncate(start);
        }
        result.map(|()| Taken::Events(out.len() - start))
    }

    fn push_events<'a>(
        &self,
        metric: &Metric<'a>,
        limits: &Limits,
        out: &mut LineEvents<'a>,
    ) -> Result<(), Reject> {
        let at_ms = match metric.timestamp_s {
            None => None,
            Some(s) => Some(
                s.checked_mul(1000)
                    .filter(|&ms| ms <= MAX_TIMESTAMP_MS)
                    .ok_or(Reject::BadTimestamp)? as i64,
            ),
        };
        let mut mapped = false;
        let wanted = match metric.kind {
            Type::Gauge => Kind::Last,
            Type::Set => Kind::Unique,
            _ => Kind::Sum,
        };
        for mapping in self.matching(metric.name) {
            mapped = true;
            if mapping.kind != wanted {
                return Err(Reject::WrongKind);
            }
            if wanted != Kind::Sum {
                let key = mapping.key(metric)?;
                if key.len() > limits.max_key_bytes {
                    return Err(Reject::KeyTooLong);
                }
                let key = protocol::parse_key(key, mapping.key_type)?;
                for value in metric.values() {
                    let (delta, value) = match wanted {
                        Kind::Unique => (1, Some(protocol::parse_value(value, limits)?)),
                        _ if matches!(value.first(), Some(b'+' | b'-')) => {
                            return Err(Reject::RelativeGauge)
                        }
                        _ => (protocol::parse_i64(value).ok_or(Reject::BadValue)?, None),
                    };
                    out.push(Event {
                        counter: mapping.counter,
                        key,
                        delta,
                        value,
                        at_ms,
                    });
                }
                continue;
            }
            let scale = match metric.rate {
                Some(rate) if rate < 1.0 && !mapping.scale => return Err(Reject::Sampled),
                Some(rate) if rate < 1.0 => Some(rate),
                _ => None,
            };
            let key = mapping.key(metric)?;
            if key.len() > limits.max_key_bytes {
                return Err(Reject::KeyTooLong);
            }
            let key = protocol::parse_key(key, mapping.key_type)?;
            for value in metric.values() {
                let delta = protocol::parse_i64(value).ok_or(Reject::BadDelta)?;
                let delta = match scale {
                    None => delta,
                    Some(rate) => scaled(delta, rate)?,
                };
                out.push(Event {
                    counter: mapping.counter,
                    key,
                    delta,
                    value: None,
                    at_ms,
                });
            }
        }
        if mapped {
            Ok(())
        } else {
            Err(Reject::UnmappedMetric)
        }
    }
}

/// `delta / rate`, rounded to the nearest integer.
fn scaled(delta: i64, rate: f64) -> Result<i64, Reject> {
    let v = (delta as f64 / rate).round();
    // i64::MAX as f64 rounds up to 2^63, which is out of range: hence `<`.
    if v >= -(i64::MAX as f64) && v < i64::MAX as f64 {
        Ok(v as i64)
    } else {
        Err(Reject::BadDelta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(metric: &str, key_tag: Option<&str>, sampled: Sampled) -> CounterStatsd {
        CounterStatsd {
            metric: metric.into(),
            key_tag: key_tag.map(Into::into),
            sampled,
        }
    }

    fn mappings() -> Mappings {
        let views = decl("page.views", Some("page"), Sampled::Reject);
        let by_user = decl("page.views", Some("user"), Sampled::Reject);
        let hits = decl("hits.*", None, Sampled::Scale);
        let ips = decl("ip.*.seen", None, Sampled::Reject);
        let temp = decl("temp.*", None, Sampled::Reject);
        let uniq = decl("uniq.*", None, Sampled::Reject);
        Mappings::new([
            (4, KeyType::Text, Kind::Last, &temp),
            (5, KeyType::Text, Kind::Unique, &uniq),
            (0, KeyType::Text, Kind::Sum, &views),
            (1, KeyType::Bigint, Kind::Sum, &by_user),
            (2, KeyType::Text, Kind::Sum, &hits),
            (3, KeyType::Inet, Kind::Sum, &ips),
        ])
    }

    /// (counter, key, delta, at_ms) of each event.
    type Events = Vec<(u16, String, i64, Option<i64>)>;

    fn events(line: &str) -> Result<Events, Reject> {
        let mut out = LineEvents::new();
        mappings().events(line.as_bytes(), &Limits::default(), &mut out)?;
        Ok(out
            .into_iter()
            .map(|e| (e.counter, e.key.to_string(), e.delta, e.at_ms))
            .collect())
    }

    #[test]
    fn tag_keys_fan_out_to_every_mapped_counter() {
        assert_eq!(
            events("page.views:2|c|#page:home,user:+007"),
            Ok(vec![(0, "home".into(), 2, None), (1, "7".into(), 2, None)])
        );
    }

    #[test]
    fn name_keys_multi_values_and_timestamps() {
        assert_eq!(
            events("hits.a:1:-3|c|T1700000000"),
            Ok(vec![
                (2, "a".into(), 1, Some(1_700_000_000_000)),
                (2, "a".into(), -3, Some(1_700_000_000_000))
            ])
        );
        assert_eq!(
            events("ip.10.0.0.1.seen:1|c"),
            Ok(vec![(3, "10.0.0.1".into(), 1, None)])
        );
        assert_eq!(events("hits.:1|c"), Err(Reject::UnmappedMetric));
    }

    #[test]
    fn a_line_is_rejected_whole() {
        // The first counter's key is good, the second's is not a bigint: nothing is taken.
        let mut out = LineEvents::new();
        let line = b"page.views:1|c|#page:home,user:bob";
        let result = mappings().events(line, &Limits::default(), &mut out);
        assert_eq!((result, out.len()), (Err(Reject::BadKey), 0));
        let line = b"hits.a:1:2:x|c";
        let result = mappings().events(line, &Limits::default(), &mut out);
        assert_eq!((result, out.len()), (Err(Reject::BadDelta), 0));
        assert_eq!(events("page.views:1|c|#page:home"), Err(Reject::MissingKey));
        assert_eq!(events("hits.a:1:x|c"), Err(Reject::BadDelta));
        assert_eq!(events("hits.a:1.5|c"), Err(Reject::BadDelta));
    }

    #[test]
    fn gauges_go_to_last_counters_and_sets_to_unique_ones() {
        let mut out = LineEvents::new();
        let line = b"temp.cpu:42|g|T1700000000";
        assert_eq!(
            mappings().events(line, &Limits::default(), &mut out),
            Ok(Taken::Events(1))
        );
        assert_eq!(
            (
                out[0].counter,
                out[0].key.as_str(),
                out[0].delta,
                out[0].value
            ),
            (4, "cpu", 42, None)
        );
        assert_eq!(out[0].at_ms, Some(1_700_000_000_000));
        out.clear();
        let line = b"uniq.home:visitor-7|s";
        assert_eq!(
            mappings().events(line, &Limits::default(), &mut out),
            Ok(Taken::Events(1))
        );
        assert_eq!(
            (out[0].counter, out[0].key.as_str(), out[0].value),
            (5, "home", Some("visitor-7"))
        );
    }

    #[test]
    fn rejections() {
        assert_eq!(events("nope:1|c"), Err(Reject::UnmappedMetric));
        assert_eq!(
            events("page.views:1|g|#page:a,user:1"),
            Err(Reject::WrongKind)
        );
        assert_eq!(events("temp.a:1|c"), Err(Reject::WrongKind));
        assert_eq!(events("page.views:x|s|#page:a"), Err(Reject::WrongKind));
        assert_eq!(events("temp.a:+1|g"), Err(Reject::RelativeGauge));
        assert_eq!(events("temp.a:-1|g"), Err(Reject::RelativeGauge));
        assert_eq!(events("temp.a:1.5|g"), Err(Reject::BadValue));
        assert_eq!(events("uniq.a:x\u{a0}y|s"), Err(Reject::BadValue));
        assert_eq!(events("hits.a:1|ms"), Err(Reject::UnsupportedType));
        assert_eq!(
            events("page.views:1|c|@0.5|#page:a,user:1"),
            Err(Reject::Sampled)
        );
        assert_eq!(
            events("hits.a:1|c|T99999999999999"),
            Err(Reject::BadTimestamp)
        );
        assert_eq!(events("hits a"), Err(Reject::BadStatsdLine));
        let long = format!("hits.{}:1|c", "k".repeat(300));
        assert_eq!(events(&long), Err(Reject::KeyTooLong));
    }

    #[test]
    fn rate_one_is_exact_and_scaling_is_opt_in() {
        assert_eq!(events("page.views:1|c|@1|#page:a,user:1").unwrap().len(), 2);
        assert_eq!(
            events("hits.a:3|c|@0.1"),
            Ok(vec![(2, "a".into(), 30, None)])
        );
        assert_eq!(
            events("hits.a:1|c|@0.3"),
            Ok(vec![(2, "a".into(), 3, None)])
        );
    }

    #[test]
    fn ignored_kinds() {
        let mut out = LineEvents::new();
        let m = mappings();
        let l = Limits::default();
        assert_eq!(m.events(b"_e{1,1}:a|b", &l, &mut out), Ok(Taken::Event));
        assert_eq!(m.events(b"_sc|x|0", &l, &mut out), Ok(Taken::ServiceCheck));
        assert_eq!(m.events(b"", &l, &mut out), Ok(Taken::Empty));
        assert!(out.is_empty());
    }

    #[test]
    fn checks() {
        assert!(decl("a", Some("t"), Sampled::Reject).check().is_ok());
        assert!(decl("a.*", None, Sampled::Reject).check().is_ok());
        assert!(decl("a", None, Sampled::Reject).check().is_err());
        assert!(decl("a.*.*", None, Sampled::Reject).check().is_err());
        assert!(decl("a:b", Some("t"), Sampled::Reject).check().is_err());
        assert!(decl("a", Some("t,u"), Sampled::Reject).check().is_err());
    }
}
