//! Time windows: the minute, hour, day, week (ISO, from Monday) or month of a time zone an event
//! time falls in, as the window's first instant in Unix milliseconds. A leaf: nothing of the
//! crate.
//!
//! Zones come from the system's zone database (`/usr/share/zoneinfo`, or `TZDIR`), read by jiff
//! when a [`Window`] is made, so a tzdata update applies at the next start without a rebuild; no
//! copy of the database is compiled in (docs/design.md, "Time windows").
//!
//! Where windows start, as instants:
//! - **day, week, month:** at the first instant of the local day (the day itself, its Monday,
//!   the first of its month). That is local midnight; where midnight occurs twice (a DST change
//!   that turns 01:00 back to 00:00, as in America/Havana) its first occurrence, so the day holds
//!   both passes (25 hours); where a DST gap skips midnight (America/Santiago's 24:00 -> 01:00,
//!   Asia/Beirut, Asia/Kathmandu's 1986 change of offset) the first instant after the gap. A day
//!   across a DST change is 23 or 25 hours long.
//! - **minute, hour:** where the local clock reads a whole minute or hour, every time it does
//!   (a repeated hour is two windows: each window is a real hour), and at each change of offset
//!   (so an hour that a change cuts in two is two windows). Asia/Kolkata's (+05:30) and
//!   Asia/Kathmandu's (+05:45) hours start at local whole hours.
//!
//! Every day start is an hour start, every hour start a minute start, and every week or month
//! start a day start: a coarser window is a union of whole finer ones (weeks are not within
//! months).

use std::path::{Path, PathBuf};

use jiff::civil::{Date, Time};
use jiff::tz::{AmbiguousOffset, Offset, TimeZone};
use jiff::{Timestamp, ToSpan};

/// How long a counter's window is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Deserialize, serde::Serialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Span {
    Minute,
    Hour,
    Day,
    /// An ISO week, Monday to Sunday.
    Week,
    Month,
}

impl Span {
    /// Every span, finest first.
    pub const ALL: [Span; 5] = [Span::Minute, Span::Hour, Span::Day, Span::Week, Span::Month];

    /// The name config.toml spells it with.
    pub fn name(self) -> &'static str {
        match self {
            Span::Minute => "minute",
            Span::Hour => "hour",
            Span::Day => "day",
            Span::Week => "week",
            Span::Month => "month",
        }
    }

    /// Whether every window of `self` is a union of whole windows of `finer`, and larger: minute
    /// ⊂ hour ⊂ day ⊂ week, day ⊂ month. A week is not within a month, nor a month a whole
    /// number of weeks.
    pub fn contains(self, finer: Span) -> bool {
        use Span::*;
        matches!(
            (finer, self),
            (Minute, Hour | Day | Week | Month) | (Hour, Day | Week | Month) | (Day, Week | Month)
        )
    }

    /// The fixed length of a minute or hour in ms; `None` for the calendar spans.
    fn fixed_ms(self) -> Option<i64> {
        match self {
            Span::Minute => Some(MINUTE_MS),
            Span::Hour => Some(HOUR_MS),
            Span::Day | Span::Week | Span::Month => None,
        }
    }
}

/// A row's span in one byte, as buckets and flushes carry it: [`ALL_SPAN`] for an all-time row,
/// else [`Span::code`].
pub type SpanCode = u8;

/// The span code of an all-time row (stored as span `all`, win '-infinity').
pub const ALL_SPAN: SpanCode = 0;

impl Span {
    /// This span's [`SpanCode`]: 1 + its position in [`Span::ALL`] (the variants are declared
    /// in that order). The router takes it once per row an event writes.
    pub fn code(self) -> SpanCode {
        self as SpanCode + 1
    }
}

/// The name a span code is stored as in the `span` column: `all`, or [`Span::name`].
pub fn span_name(code: SpanCode) -> &'static str {
    match code.checked_sub(1).and_then(|i| Span::ALL.get(i as usize)) {
        Some(span) => span.name(),
        None => "all",
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The `win` of an all-time row: stored as '-infinity'. No window starts there (the first
/// window starts at `i64::MIN + 1`).
pub const ALL_TIME: i64 = i64::MIN;

const MINUTE_MS: i64 = 60_000;
const HOUR_MS: i64 = 3_600_000;
const DAY_MS: i64 = 86_400_000;

/// The instants windows are computed for: about the years -9976 to 9987, well inside jiff's
/// range (-9999 to 9999) so that a window's civil arithmetic (a month either side, any offset)
/// never leaves it. An earlier time belongs to the first window, which starts at
/// `i64::MIN + 1`; a later one to the last, which ends at `i64::MAX`.
const MIN_MS: i64 = -377_000_000_000_000;
const MAX_MS: i64 = 253_000_000_000_000;

/// Whether the window holding `at_ms` can be named (see [`Window::name_of`]): events and
/// corrections of windowed counters outside are refused (`unnamed_window`), since every later
/// instant would fall in one last window that no date names.
pub fn nameable(at_ms: i64) -> bool {
    (MIN_MS..MAX_MS).contains(&at_ms)
}

/// The directories jiff searches after `TZDIR`, in order (jiff's own list for Unix).
const ZONEINFO_DIRS: [&str; 3] = [
    "/usr/share/zoneinfo",
    "/usr/share/lib/zoneinfo",
    "/etc/zoneinfo",
];

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("unknown time zone {zone:?}: the zone database in {} has no such zone (an IANA name such as \"Europe/Berlin\"; TZDIR sets the directory)", dir.display())]
    UnknownZone { zone: String, dir: PathBuf },
    #[error("unknown time zone {zone:?}: no zone database found in {} (install tzdata, or set TZDIR to its directory)", looked_in(tzdir.as_deref()))]
    NoDatabase {
        zone: String,
        /// `TZDIR`, when it was set.
        tzdir: Option<PathBuf>,
    },
    #[error("time zone {zone:?}: TZDIR={} holds no zone database (no zone file in it); set TZDIR to the zone database's directory (such as /usr/share/zoneinfo), or unset it to use the system's", dir.display())]
    EmptyTzdir { zone: String, dir: PathBuf },
    #[error("time zone {zone:?}: its zone file {} is damaged: {cause}", path.display())]
    Damaged {
        zone: String,
        path: PathBuf,
        cause: String,
    },
}

fn looked_in(tzdir: Option<&Path>) -> String {
    let mut dirs: Vec<String> = ZONEINFO_DIRS.iter().map(|d| d.to_string()).collect();
    if let Some(dir) = tzdir {
        dirs.insert(0, format!("TZDIR={}", dir.display()));
    }
    dirs.join(", ")
}

impl WindowError {
    /// `zone` is not in the database jiff reads: which directory that is (the one jiff picks:
    /// `TZDIR` if it is a directory, else the first of its list that is), or that there is none.
    fn unknown(zone: &str, tzdir: Option<&Path>) -> WindowError {
        let tzdir = tzdir.map(Path::to_path_buf);
        let dir = tzdir
            .iter()
            .cloned()
            .chain(ZONEINFO_DIRS.iter().map(PathBuf::from))
            .find(|d| d.is_dir());
        let zone = zone.to_string();
        match dir {
            Some(dir) => WindowError::UnknownZone { zone, dir },
            None => WindowError::NoDatabase { zone, tzdir },
        }
    }
}

/// The zone `time_zone` from the directory `tzdir` (`TZDIR`) when it is one, and then from it
/// alone: a `TZDIR` without zone files is reported, not passed over for the system's database
/// (which jiff would do). A zone file that cannot be read as one is reported with what was
/// found, not as a missing zone.
fn load_zone(time_zone: &str, tzdir: Option<&Path>) -> Result<TimeZone, WindowError> {
    let zone = time_zone.to_string();
    let own = tzdir.filter(|d| d.is_dir());
    let found = match own {
        // UTC needs no database.
        _ if time_zone.eq_ignore_ascii_case("UTC") => return Ok(TimeZone::UTC),
        Some(dir) => {
            let db =
                jiff::tz::TimeZoneDatabase::from_dir(dir).map_err(|_| WindowError::EmptyTzdir {
                    zone: zone.clone(),
                    dir: dir.to_path_buf(),
                })?;
            if db.is_definitively_empty() {
                let dir = dir.to_path_buf();
                return Err(WindowError::EmptyTzdir { zone, dir });
            }
            db.get(time_zone)
        }
        None => TimeZone::get(time_zone),
    };
    if let Some(z) = found.ok().filter(|z| !z.is_unknown()) {
        return Ok(z);
    }
    // Not found: a file of that name that is no zone file is reported as what it is.
    let dir = own
        .map(Path::to_path_buf)
        .or_else(|| ZONEINFO_DIRS.iter().map(PathBuf::from).find(|d| d.is_dir()));
    let safe = !time_zone.is_empty() && !time_zone.split('/').any(|p| p.is_empty() || p == "..");
    if let (Some(dir), true) = (dir, safe) {
        let path = dir.join(time_zone);
        if let Ok(bytes) = std::fs::read(&path) {
            if let Err(cause) = TimeZone::tzif(time_zone, &bytes) {
                let cause = cause.to_string();
                return Err(WindowError::Damaged { zone, path, cause });
            }
        }
    }
    Err(WindowError::unknown(time_zone, tzdir))
}

/// A span in a time zone: which window an instant falls in.
///
/// [`Window::bounds`] makes no system call and allocates nothing: the zone's transitions were
/// read from its file once, by [`Window::new`], and an offset lookup is a search of them in
/// memory (or, past the file's last transition, its POSIX rule computed for that year).
#[derive(Clone, Debug)]
pub struct Window {
    span: Span,
    zone: TimeZone,
    zone_name: String,
}

impl Window {
    /// `span` in `time_zone`, an IANA name (`Europe/Berlin`; `UTC` needs no database). Reads the
    /// zone's file.
    pub fn new(span: Span, time_zone: &str) -> Result<Window, WindowError> {
        let tzdir = std::env::var_os("TZDIR").map(PathBuf::from);
        let zone = load_zone(time_zone, tzdir.as_deref())?;
        // The database's spelling (its names match case-insensitively).
        let zone_name = zone.iana_name().unwrap_or(time_zone).to_string();
        Ok(Window {
            span,
            zone,
            zone_name,
        })
    }

    pub fn span(&self) -> Span {
        self.span
    }

    /// Another span in the same zone (an `also` window), without reading the zone again.
    pub fn with_span(&self, span: Span) -> Window {
        Window {
            span,
            ..self.clone()
        }
    }

    /// The zone's IANA name, as the database spells it.
    pub fn zone_name(&self) -> &str {
        &self.zone_name
    }

    /// How a person names the window starting at `start_ms`, in the zone: its first day for a
    /// day or week (`2026-11-23`), the month for a month (`2026-11`), the local start with its
    /// offset for a minute or hour (`2026-11-25T14:00+01:00`).
    pub fn name_of(&self, start_ms: i64) -> String {
        let Ok(at) = Timestamp::from_millisecond(start_ms) else {
            return start_ms.to_string();
        };
        let local = self.zone.to_datetime(at);
        match self.span {
            Span::Day | Span::Week => local.strftime("%Y-%m-%d").to_string(),
            Span::Month => local.strftime("%Y-%m").to_string(),
            Span::Hour | Span::Minute => {
                let offset = self.zone.to_offset(at).seconds();
                let (sign, abs) = if offset < 0 {
                    ('-', -offset)
                } else {
                    ('+', offset)
                };
                format!(
                    "{}{sign}{:02}:{:02}",
                    local.strftime("%Y-%m-%dT%H:%M"),
                    abs / 3600,
                    abs % 3600 / 60
                )
            }
        }
    }

    /// The instant `text` names in the zone: a local date (`2026-11-25`: its first instant), a
    /// local date and time (`2026-11-25T14:00`), or an instant with an offset or `Z`.
    pub fn parse_instant(&self, text: &str) -> Result<i64, String> {
        let unnamed = || {
            format!(
                "{text:?} is outside the windows tallyd can name (from about the year -9976 \
                 to 9987-04-02T17:46:39.999Z): no event there is taken"
            )
        };
        if let Ok(at) = text.parse::<Timestamp>() {
            let ms = at.as_millisecond();
            return nameable(ms).then_some(ms).ok_or_else(unnamed);
        }
        let local = match text.parse::<jiff::civil::DateTime>() {
            Ok(dt) => dt,
            Err(_) => text
                .parse::<Date>()
                .map_err(|e| {
                    format!("{text:?} is not a date, a local date and time, or an instant: {e}")
                })?
                .to_datetime(Time::midnight()),
        };
        // Past the last nameable day the zone's arithmetic may itself leave jiff's range.
        let last = Timestamp::from_millisecond(MAX_MS - 1).map(|t| TimeZone::UTC.to_datetime(t));
        if last.is_ok_and(|l| local.date() > l.date()) {
            return Err(unnamed());
        }
        let ms = self
            .zone
            .to_ambiguous_timestamp(local)
            .compatible()
            .map(|at| at.as_millisecond())
            .map_err(|e| format!("{text:?} in {}: {e}", self.zone_name))?;
        nameable(ms).then_some(ms).ok_or_else(unnamed)
    }

    /// `[start, end)` in Unix ms of the window holding `unix_ms`. Any i64 but [`ALL_TIME`]: the
    /// protocol's timestamps (0 to year 9999) and earlier ones alike; outside about
    /// -9976..9987 the first and last windows stretch to `i64::MIN + 1` and `i64::MAX`.
    pub fn bounds(&self, unix_ms: i64) -> (i64, i64) {
        let t = unix_ms.clamp(MIN_MS, MAX_MS);
        let (start, end) = match self.span.fixed_ms() {
            Some(unit) => self.fixed(t, unit),
            None => self.calendar(t),
        };
        (
            if start <= MIN_MS { i64::MIN + 1 } else { start },
            if end > MAX_MS { i64::MAX } else { end },
        )
    }

    /// The start of the window `n` windows before the one starting at `start_ms` (0: that
    /// window's own start). Days, weeks and months count in the local calendar (`n` days back
    /// across a DST change is `n` local days); minutes and hours in real time (each is a real
    /// minute or hour, so `n` hours back is `n` windows back, but for an hour a change of
    /// offset cut in two). The retention cut-off.
    pub fn back(&self, start_ms: i64, n: u32) -> i64 {
        if let Some(unit) = self.span.fixed_ms() {
            return self.bounds(start_ms.saturating_sub(i64::from(n) * unit)).0;
        }
        let t = start_ms.clamp(MIN_MS, MAX_MS);
        let label = self.label(self.zone.to_datetime(ts(t)).date());
        let n = i64::from(n);
        let span = match self.span {
            Span::Day => jiff::Span::new().try_days(n),
            Span::Week => jiff::Span::new().try_weeks(n),
            _ => jiff::Span::new().try_months(n),
        };
        match span.and_then(|s| label.checked_sub(s)) {
            // Earlier dates all lie in the first window.
            Ok(day) if day.year() > -9990 => self.bounds(self.first_instant(day)).0,
            _ => i64::MIN + 1,
        }
    }

    /// The offset in force at `t`, in ms.
    fn offset_ms(&self, t: i64) -> i64 {
        i64::from(self.zone.to_offset(ts(t)).seconds()) * 1000
    }

    /// A minute or hour window: the local clock's whole `unit` before and after `t` at `t`'s
    /// offset, cut at a change of offset between them. Assumes at most one change within one
    /// window, true of every zone.
    fn fixed(&self, t: i64, unit: i64) -> (i64, i64) {
        let offset = self.offset_ms(t);
        let local = t + offset;
        let floor = local - local.rem_euclid(unit);
        let mut start = floor - offset;
        if self.offset_ms(start) != offset {
            // The offset changed in (start, t]: the clock did not read `floor` at `t`'s offset.
            start = self.first_change(start, t);
        }
        let mut end = floor + unit - offset;
        if self.offset_ms(end - 1) != offset {
            end = self.first_change(t, end - 1);
        }
        (start, end)
    }

    /// A day, week or month window: from the first instant of its local day to that of the next
    /// window's. The loops step on only where a change of offset turns the clock back across a
    /// window start (a change that sets the clock back across midnight), so that windows stay
    /// a partition of time.
    fn calendar(&self, t: i64) -> (i64, i64) {
        let mut label = self.label(self.zone.to_datetime(ts(t)).date());
        let mut start = self.first_instant(label);
        let mut next = self.step(label, 1);
        let mut end = self.first_instant(next);
        while t >= end {
            (label, start) = (next, end);
            next = self.step(label, 1);
            end = self.first_instant(next);
        }
        while t < start {
            end = start;
            label = self.step(label, -1);
            start = self.first_instant(label);
        }
        (start, end)
    }

    /// The first day of the window holding `day`: itself, its Monday, the first of its month.
    fn label(&self, day: Date) -> Date {
        match self.span {
            Span::Week => self.step_days(day, -i64::from(day.weekday().to_monday_zero_offset())),
            Span::Month => day.first_of_month(),
            _ => day,
        }
    }

    /// The first day of the window `n` windows after the one `label` starts (within a month of
    /// it: in range, since times are clamped well inside jiff's).
    fn step(&self, label: Date, n: i64) -> Date {
        match self.span {
            Span::Week => self.step_days(label, 7 * n),
            Span::Month => label.checked_add(n.months()).unwrap_or(label),
            _ => self.step_days(label, n),
        }
    }

    fn step_days(&self, day: Date, n: i64) -> Date {
        day.checked_add(n.days()).unwrap_or(day)
    }

    /// The first instant of local `day`: its midnight, the first occurrence of a repeated
    /// midnight, or the end of a gap that skips it.
    fn first_instant(&self, day: Date) -> i64 {
        let midnight = day.to_datetime(Time::midnight());
        let local = Offset::UTC
            .to_timestamp(midnight)
            .map_or(0, |t| t.as_millisecond());
        let ms = |o: Offset| i64::from(o.seconds()) * 1000;
        match self.zone.to_ambiguous_timestamp(midnight).offset() {
            AmbiguousOffset::Unambiguous { offset } => local - ms(offset),
            AmbiguousOffset::Fold { before, .. } => local - ms(before),
            // Midnight at the later offset comes before the change, at the earlier after it.
            AmbiguousOffset::Gap { before, after } => {
                self.first_change(local - ms(after), local - ms(before))
            }
        }
    }

    /// The first instant in `(lo, hi]` whose offset differs from `lo`'s, given that `hi`'s does:
    /// a change of offset, found to the millisecond by bisection (each step an offset lookup).
    fn first_change(&self, mut lo: i64, mut hi: i64) -> i64 {
        let offset = self.offset_ms(lo);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.offset_ms(mid) == offset {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        hi
    }
}

/// `ms` (clamped into range by every caller) as jiff's timestamp.
fn ts(ms: i64) -> Timestamp {
    Timestamp::from_millisecond(ms.clamp(MIN_MS - 2 * DAY_MS, MAX_MS + 62 * DAY_MS))
        .unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Per connection and counter: the last window seen, so the common case is two compares. Used
/// with one [`Window`] only (a new one starts a new cache).
#[derive(Default, Clone, Copy, Debug)]
pub struct WindowCache {
    start: i64,
    end: i64,
}

impl WindowCache {
    /// The start, in Unix ms, of `w`'s window holding `unix_ms`: the cached one when it holds
    /// it, else [`Window::bounds`] (no system call, no allocation).
    #[inline]
    pub fn start_of(&mut self, w: &Window, unix_ms: i64) -> i64 {
        if unix_ms >= self.start && unix_ms < self.end {
            return self.start;
        }
        let (start, end) = w.bounds(unix_ms);
        *self = WindowCache { start, end };
        start
    }
}

#[cfg(test)]
mod tests;
