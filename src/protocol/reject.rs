//! Why a line was rejected: the one reason type every part of the protocol (framing, keys,
//! parsing) and the statsd parser report, and the label values of `tallyd_lines_rejected_total`.

/// Why a line was rejected. Stable snake_case names ([`Reject::as_str`]) are metric label values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Reject {
    #[error("unknown counter")]
    UnknownCounter,
    #[error("missing key")]
    MissingKey,
    #[error("key is not valid for the counter's key type")]
    BadKey,
    #[error("key too long")]
    KeyTooLong,
    #[error("delta is not a 64-bit integer")]
    BadDelta,
    #[error("timestamp is not a unix time in milliseconds up to year 9999")]
    BadTimestamp,
    #[error("too many fields")]
    TooManyFields,
    #[error("line too long")]
    TooLong,
    #[error("unknown command")]
    UnknownCommand,
    /// Stream ended in the middle of a line (no terminating newline).
    #[error("line not terminated by a newline")]
    Unterminated,
    /// Applying the delta would overflow the 64-bit sum (used by the aggregator, not the parser).
    #[error("counter sum would overflow")]
    Overflow,
    /// A statsd line for a metric no counter maps (see `statsd::mapping`).
    #[error("no counter maps this statsd metric")]
    UnmappedMetric,
    /// A statsd counter line with a sample rate below 1, for a counter that does not scale.
    #[error("sampled statsd line cannot be counted exactly")]
    Sampled,
    /// A statsd gauge, timer, histogram, distribution or set.
    #[error("statsd metric type is not a counter")]
    UnsupportedType,
    /// A line on a statsd socket that is not statsd.
    #[error("not a statsd line")]
    BadStatsdLine,
    /// An event of a windowed counter older than the windows it keeps (`keep_windows`): its
    /// window is deleted, or about to be.
    #[error("event time is before the windows the counter keeps")]
    Expired,
    /// A unique, max, min or last counter's event without its value.
    #[error("missing value")]
    MissingValue,
    /// A max, min or last value that is not a 64-bit integer, or a unique value that is not
    /// valid text (UTF-8 without control characters or Unicode whitespace).
    #[error("value is not valid for the counter's kind")]
    BadValue,
    /// A unique value longer than `max_key_bytes`.
    #[error("value too long")]
    ValueTooLong,
    /// A statsd gauge or set into a counter of another kind (a gauge needs `last`, a set
    /// `unique`), or a counter line into one that is not a sum.
    #[error("statsd metric type does not match the counter's kind")]
    WrongKind,
    /// A statsd gauge with a sign (`+3|g`): a change to a value tallyd may not hold.
    #[error("relative statsd gauges are not taken")]
    RelativeGauge,
    /// A `!set` on a counter whose total cannot be set exactly: a unique counter, one folded
    /// into an application's table (`rollup_into`), a windowed max, min or last counter that
    /// writes `also` rows (coarser windows, the all-time total) with its window's.
    #[error("this counter's total cannot be set")]
    NotSettable,
    #[error("event time from 9987-04-02T17:46:40Z on: a windowed counter's window there cannot be named")]
    UnnamedWindow,
}

impl Reject {
    pub const ALL: [Reject; 23] = [
        Reject::UnknownCounter,
        Reject::MissingKey,
        Reject::BadKey,
        Reject::KeyTooLong,
        Reject::BadDelta,
        Reject::BadTimestamp,
        Reject::TooManyFields,
        Reject::TooLong,
        Reject::UnknownCommand,
        Reject::Unterminated,
        Reject::Overflow,
        Reject::UnmappedMetric,
        Reject::Sampled,
        Reject::UnsupportedType,
        Reject::BadStatsdLine,
        Reject::Expired,
        Reject::MissingValue,
        Reject::BadValue,
        Reject::ValueTooLong,
        Reject::WrongKind,
        Reject::RelativeGauge,
        Reject::NotSettable,
        Reject::UnnamedWindow,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reject::UnknownCounter => "unknown_counter",
            Reject::MissingKey => "missing_key",
            Reject::BadKey => "bad_key",
            Reject::KeyTooLong => "key_too_long",
            Reject::BadDelta => "bad_delta",
            Reject::BadTimestamp => "bad_timestamp",
            Reject::TooManyFields => "too_many_fields",
            Reject::TooLong => "too_long",
            Reject::UnknownCommand => "unknown_command",
            Reject::Unterminated => "unterminated",
            Reject::Overflow => "overflow",
            Reject::UnmappedMetric => "unmapped_metric",
            Reject::Sampled => "sampled",
            Reject::UnsupportedType => "unsupported_type",
            Reject::BadStatsdLine => "bad_statsd_line",
            Reject::Expired => "expired",
            Reject::MissingValue => "missing_value",
            Reject::BadValue => "bad_value",
            Reject::ValueTooLong => "value_too_long",
            Reject::WrongKind => "wrong_kind",
            Reject::RelativeGauge => "relative_gauge",
            Reject::NotSettable => "not_settable",
            Reject::UnnamedWindow => "unnamed_window",
        }
    }
}
