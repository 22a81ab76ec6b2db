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
//! - Only counter lines (`|c`) count; a value must be a 64-bit integer; `|T<unix_s>` is the
//!   event time; multi-value lines give one event per value.
//! - A sample rate below 1 is rejected (`sampled`) unless every counter the metric maps to sets
//!   `sampled = "scale"`: each value is then divided by the rate and rounded (approximate).

use std::collections::HashMap;

use super::parse::{self, Kind, Metric, Packet};
use smallvec::SmallVec;

use crate::config::{CounterStatsd, Sampled};
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
    /// `decl`: (counter index, key type, mapping) for each counter that has one.
    pub fn new<'a>(decl: impl IntoIterator<Item = (u16, KeyType, &'a CounterStatsd)>) -> Mappings {
        let mut m = Mappings::default();
        for (counter, key_type, s) in decl {
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
        if metric.kind != Kind::Counter {
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
        for mapping in self.matching(metric.name) {
            mapped = true;
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
        Mappings::new([
            (0, KeyType::Text, &views),
            (1, KeyType::Bigint, &by_user),
            (2, KeyType::Text, &hits),
            (3, KeyType::Inet, &ips),
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
    fn rejections() {
        assert_eq!(events("nope:1|c"), Err(Reject::UnmappedMetric));
        assert_eq!(
            events("page.views:1|g|#page:a,user:1"),
            Err(Reject::UnsupportedType)
        );
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
