//! Unit tests of the windows: every kind of zone change walked over years, the nesting `also`
//! relies on, retention, and that a window lookup allocates nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use super::*;

/// Counts this thread's allocations, so that a test can show a piece of code makes none while
/// the other tests run on their own threads.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // A const-initialised thread-local without a destructor: reading it never allocates.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(|n| n.get())
}

/// An RFC 3339 time in Unix ms.
fn at(text: &str) -> i64 {
    text.parse::<Timestamp>()
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .as_millisecond()
}

fn window(span: Span, zone: &str) -> Window {
    Window::new(span, zone).unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts that each time in `times` is in the window `[start, end)`, and the instants either
/// side of it are not.
fn assert_window(w: &Window, times: &[&str], start: &str, end: &str) {
    let bounds = (at(start), at(end));
    for t in times {
        assert_eq!(
            w.bounds(at(t)),
            bounds,
            "{t} in {} {}",
            w.span(),
            w.zone_name()
        );
    }
    assert_eq!(w.bounds(bounds.0).0, bounds.0, "{start} starts a window");
    assert_eq!(
        w.bounds(bounds.0 - 1).1,
        bounds.0,
        "{start} ends the one before"
    );
    assert_eq!(
        w.bounds(bounds.1).0,
        bounds.1,
        "{end} starts the next window"
    );
}

const H: i64 = 3_600_000;

#[test]
fn a_utc_day_is_midnight_to_midnight() {
    let w = window(Span::Day, "UTC");
    assert_window(
        &w,
        &[
            "2026-05-17T00:00:00Z",
            "2026-05-17T13:45:00Z",
            "2026-05-17T23:59:59.999Z",
        ],
        "2026-05-17T00:00:00Z",
        "2026-05-18T00:00:00Z",
    );
    assert_eq!(w.bounds(0), (0, 24 * H));
    assert_eq!(w.bounds(-1), (-24 * H, 0));
}

#[test]
fn berlin_spring_forward_day_is_23_hours() {
    let w = window(Span::Day, "Europe/Berlin");
    // 2026-03-29: 02:00 CET becomes 03:00 CEST.
    assert_window(
        &w,
        &[
            "2026-03-29T00:00:00+01:00",
            "2026-03-29T01:59:59.999+01:00",
            "2026-03-29T03:00:00+02:00",
            "2026-03-29T23:59:59.999+02:00",
        ],
        "2026-03-29T00:00:00+01:00",
        "2026-03-30T00:00:00+02:00",
    );
    let (s, e) = w.bounds(at("2026-03-29T12:00:00+02:00"));
    assert_eq!(e - s, 23 * H);
    // Either side of the local midnights.
    assert_window(
        &w,
        &["2026-03-28T23:59:59.999+01:00"],
        "2026-03-28T00:00:00+01:00",
        "2026-03-29T00:00:00+01:00",
    );
    assert_window(
        &w,
        &["2026-03-30T00:00:00+02:00"],
        "2026-03-30T00:00:00+02:00",
        "2026-03-31T00:00:00+02:00",
    );
}

#[test]
fn berlin_fall_back_day_is_25_hours() {
    let w = window(Span::Day, "Europe/Berlin");
    // 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:00 to 03:00 happens twice.
    assert_window(
        &w,
        &[
            "2026-10-25T00:00:00+02:00",
            "2026-10-25T02:30:00+02:00",
            "2026-10-25T02:30:00+01:00",
            "2026-10-25T23:59:59.999+01:00",
        ],
        "2026-10-25T00:00:00+02:00",
        "2026-10-26T00:00:00+01:00",
    );
    let (s, e) = w.bounds(at("2026-10-25T12:00:00+01:00"));
    assert_eq!(e - s, 25 * H);
    assert_window(
        &w,
        &["2026-10-24T23:59:59.999+02:00"],
        "2026-10-24T00:00:00+02:00",
        "2026-10-25T00:00:00+02:00",
    );
    assert_window(
        &w,
        &["2026-10-26T00:00:00+01:00"],
        "2026-10-26T00:00:00+01:00",
        "2026-10-27T00:00:00+01:00",
    );
}

#[test]
fn berlin_hours_are_real_hours_across_both_changes() {
    let w = window(Span::Hour, "Europe/Berlin");
    // Spring: 01:00 CET is followed by 03:00 CEST.
    assert_window(
        &w,
        &["2026-03-29T01:59:59.999+01:00"],
        "2026-03-29T01:00:00+01:00",
        "2026-03-29T03:00:00+02:00",
    );
    // Fall: the two 02:00 hours are two windows.
    assert_window(
        &w,
        &["2026-10-25T02:30:00+02:00"],
        "2026-10-25T02:00:00+02:00",
        "2026-10-25T02:00:00+01:00",
    );
    assert_window(
        &w,
        &["2026-10-25T02:30:00+01:00"],
        "2026-10-25T02:00:00+01:00",
        "2026-10-25T03:00:00+01:00",
    );
}

#[test]
fn an_iso_week_runs_monday_to_sunday_across_a_year_end() {
    let w = window(Span::Week, "UTC");
    assert_window(
        &w,
        &[
            "2026-12-28T00:00:00Z",
            "2026-12-31T23:59:59.999Z",
            "2027-01-01T00:00:00Z",
            "2027-01-03T23:59:59.999Z",
        ],
        "2026-12-28T00:00:00Z",
        "2027-01-04T00:00:00Z",
    );
    assert_window(
        &w,
        &["2027-01-04T00:00:00Z"],
        "2027-01-04T00:00:00Z",
        "2027-01-11T00:00:00Z",
    );
    // In a zone: from its Monday's midnight.
    let berlin = window(Span::Week, "Europe/Berlin");
    assert_window(
        &berlin,
        &["2027-01-03T23:59:59.999+01:00"],
        "2026-12-28T00:00:00+01:00",
        "2027-01-04T00:00:00+01:00",
    );
}

#[test]
fn months_end_on_their_last_day() {
    let w = window(Span::Month, "UTC");
    assert_window(
        &w,
        &["2028-02-29T12:00:00Z", "2028-02-29T23:59:59.999Z"],
        "2028-02-01T00:00:00Z",
        "2028-03-01T00:00:00Z",
    );
    assert_window(
        &w,
        &["2028-03-01T00:00:00Z"],
        "2028-03-01T00:00:00Z",
        "2028-04-01T00:00:00Z",
    );
    assert_window(
        &w,
        &["2026-02-28T23:59:59.999Z"],
        "2026-02-01T00:00:00Z",
        "2026-03-01T00:00:00Z",
    );
    assert_window(
        &w,
        &["2026-12-31T23:59:59.999Z"],
        "2026-12-01T00:00:00Z",
        "2027-01-01T00:00:00Z",
    );
    // Berlin's March holds the spring change: 31 days less an hour.
    let berlin = window(Span::Day, "Europe/Berlin").with_span(Span::Month);
    assert_eq!(berlin.zone_name(), "Europe/Berlin");
    assert_window(
        &berlin,
        &["2026-03-31T23:59:59.999+02:00"],
        "2026-03-01T00:00:00+01:00",
        "2026-04-01T00:00:00+02:00",
    );
}

#[test]
fn half_and_three_quarter_hour_zones_start_hours_at_local_whole_hours() {
    let kolkata = window(Span::Hour, "Asia/Kolkata");
    assert_window(
        &kolkata,
        &["2026-05-17T10:00:00+05:30", "2026-05-17T10:59:59.999+05:30"],
        "2026-05-17T04:30:00Z",
        "2026-05-17T05:30:00Z",
    );
    let kathmandu = window(Span::Hour, "Asia/Kathmandu");
    assert_window(
        &kathmandu,
        &["2026-05-17T10:15:00+05:45", "2026-05-17T10:59:59.999+05:45"],
        "2026-05-17T04:15:00Z",
        "2026-05-17T05:15:00Z",
    );
    let day = window(Span::Day, "Asia/Kathmandu");
    assert_window(
        &day,
        &["2026-05-17T00:00:00+05:45"],
        "2026-05-16T18:15:00Z",
        "2026-05-17T18:15:00Z",
    );
}

/// Where a DST gap skips local midnight, the day starts at the first instant after the gap.
#[test]
fn a_day_whose_midnight_is_skipped_starts_after_the_gap() {
    // America/Santiago, 2026-09-06: 24:00 -04 becomes 01:00 -03.
    let w = window(Span::Day, "America/Santiago");
    assert_window(
        &w,
        &["2026-09-06T01:00:00-03:00", "2026-09-06T23:59:59.999-03:00"],
        "2026-09-06T01:00:00-03:00",
        "2026-09-07T00:00:00-03:00",
    );
    assert_window(
        &w,
        &["2026-09-05T23:59:59.999-04:00"],
        "2026-09-05T00:00:00-04:00",
        "2026-09-06T01:00:00-03:00",
    );
    // Asia/Kathmandu, 1986-01-01: 00:00 +05:30 became 00:15 +05:45; the month and the hour
    // start there too.
    let first = "1986-01-01T00:15:00+05:45";
    for span in [Span::Day, Span::Month, Span::Hour] {
        assert_eq!(
            window(span, "Asia/Kathmandu").bounds(at(first)).0,
            at(first),
            "{span}"
        );
    }
}

/// Where midnight happens twice (America/Havana turns 01:00 back to 00:00), the day starts at
/// the first and holds both passes; each pass is an hour window of its own.
#[test]
fn a_repeated_midnight_starts_the_day_at_its_first_pass() {
    let w = window(Span::Day, "America/Havana");
    assert_window(
        &w,
        &["2026-11-01T00:30:00-04:00", "2026-11-01T00:30:00-05:00"],
        "2026-11-01T00:00:00-04:00",
        "2026-11-02T00:00:00-05:00",
    );
    let hour = window(Span::Hour, "America/Havana");
    assert_window(
        &hour,
        &["2026-11-01T00:30:00-05:00"],
        "2026-11-01T00:00:00-05:00",
        "2026-11-01T01:00:00-05:00",
    );
}

#[test]
fn back_counts_local_days_and_months_and_real_hours() {
    let day = window(Span::Day, "Europe/Berlin");
    let march_30 = at("2026-03-30T00:00:00+02:00");
    assert_eq!(day.back(march_30, 0), march_30);
    assert_eq!(day.back(march_30, 1), at("2026-03-29T00:00:00+01:00"));
    assert_eq!(day.back(march_30, 2), at("2026-03-28T00:00:00+01:00"));
    let october_26 = at("2026-10-26T00:00:00+01:00");
    assert_eq!(day.back(october_26, 1), at("2026-10-25T00:00:00+02:00"));
    assert_eq!(day.back(october_26, 366), at("2025-10-25T00:00:00+02:00"));

    let month = window(Span::Month, "Europe/Berlin");
    let april = at("2026-04-01T00:00:00+02:00");
    assert_eq!(month.back(april, 1), at("2026-03-01T00:00:00+01:00"));
    assert_eq!(month.back(april, 2), at("2026-02-01T00:00:00+01:00"));
    assert_eq!(month.back(april, 16), at("2024-12-01T00:00:00+01:00"));
    let utc = window(Span::Month, "UTC");
    assert_eq!(
        utc.back(at("2028-03-01T00:00:00Z"), 1),
        at("2028-02-01T00:00:00Z")
    );
    assert_eq!(
        utc.back(at("2026-05-01T00:00:00Z"), 3),
        at("2026-02-01T00:00:00Z")
    );

    let week = window(Span::Week, "UTC");
    assert_eq!(
        week.back(at("2027-01-04T00:00:00Z"), 1),
        at("2026-12-28T00:00:00Z")
    );

    // Hours: the missing 02:00 is no window; the repeated one is two.
    let hour = window(Span::Hour, "Europe/Berlin");
    assert_eq!(
        hour.back(at("2026-03-29T04:00:00+02:00"), 2),
        at("2026-03-29T01:00:00+01:00")
    );
    assert_eq!(
        hour.back(at("2026-10-25T03:00:00+01:00"), 2),
        at("2026-10-25T02:00:00+02:00")
    );
    let minute = window(Span::Minute, "UTC");
    assert_eq!(
        minute.back(at("2026-01-01T00:00:00Z"), 61),
        at("2025-12-31T22:59:00Z")
    );
    // Far back: the first window.
    assert_eq!(month.back(april, u32::MAX), i64::MIN + 1);
    assert_eq!(hour.back(0, u32::MAX), i64::MIN + 1);
    assert_eq!(window(Span::Hour, "UTC").back(0, 1000), -1000 * H);
}

#[test]
fn the_whole_protocol_range_has_windows() {
    for span in Span::ALL {
        for zone in ["UTC", "Pacific/Kiritimati", "Pacific/Pago_Pago"] {
            let w = window(span, zone);
            for t in [
                0,
                -1,
                253_402_300_799_999,
                i64::MIN + 1,
                i64::MAX - 1,
                -62_135_596_800_000,
            ] {
                let (s, e) = w.bounds(t);
                assert!(
                    s <= t && t < e && s > ALL_TIME,
                    "{span} {zone} {t}: [{s}, {e})"
                );
            }
            let (_, last_end) = w.bounds(253_402_300_799_999);
            assert_eq!(last_end, i64::MAX, "{span} {zone}");
        }
    }
}

/// A week or month is a union of whole days, a day of whole hours, an hour of whole minutes;
/// windows follow each other without a gap; days are local days (22 to 26 hours), hours at
/// most an hour. Over years with changes of every kind.
#[test]
fn windows_tile_time_and_nest() {
    for zone in [
        "UTC",
        "Europe/Berlin",
        "America/Havana",
        "America/Santiago",
        "Asia/Beirut",
        "America/Sao_Paulo",
        "Australia/Lord_Howe",
        "Asia/Kathmandu",
        "Asia/Kolkata",
    ] {
        let [minute, hour, day, week, month] = Span::ALL.map(|s| window(s, zone));
        let walk = |w: &Window, from: &str, to: &str, check: &dyn Fn(i64, i64)| {
            let (mut s, to) = (w.bounds(at(from)).0, at(to));
            while s < to {
                let (start, e) = w.bounds(s);
                assert_eq!(start, s, "{zone} {}", w.span());
                assert!(s < e, "{zone} {}: [{s}, {e})", w.span());
                assert_eq!(w.bounds(e - 1), (s, e), "{zone} {}", w.span());
                check(s, e);
                s = e;
            }
        };
        walk(
            &day,
            "1985-06-01T00:00:00Z",
            "2028-01-01T00:00:00Z",
            &|s, e| {
                assert!(
                    (22 * H..=26 * H).contains(&(e - s)),
                    "{zone}: day [{s}, {e})"
                );
                assert_eq!(hour.bounds(s).0, s, "{zone}: the day at {s} starts an hour");
            },
        );
        walk(
            &hour,
            "2016-01-01T00:00:00Z",
            "2017-01-01T00:00:00Z",
            &|s, e| {
                assert!(e - s <= H, "{zone}: hour [{s}, {e})");
                assert_eq!(
                    minute.bounds(s).0,
                    s,
                    "{zone}: the hour at {s} starts a minute"
                );
            },
        );
        for coarse in [&week, &month] {
            walk(
                coarse,
                "2010-01-01T00:00:00Z",
                "2028-01-01T00:00:00Z",
                &|s, _| {
                    assert_eq!(
                        day.bounds(s).0,
                        s,
                        "{zone}: the {} at {s} starts a day",
                        coarse.span()
                    );
                },
            );
        }
    }
}

#[test]
fn the_cache_answers_as_bounds_without_allocating() {
    let before = allocations();
    drop(std::hint::black_box(Vec::<u8>::with_capacity(8)));
    assert_eq!(allocations() - before, 1, "the counting allocator counts");

    const MIN: i64 = 60_000;
    // Each from a few days before a change of offset, stepping a fraction of its window.
    let windows: Vec<(Window, i64, i64)> = [
        (Span::Day, "Europe/Berlin", "2026-03-27T10:00:00Z", 7 * H),
        (Span::Day, "America/Santiago", "2026-09-04T10:00:00Z", 7 * H),
        (Span::Day, "America/Havana", "2026-10-30T10:00:00Z", 7 * H),
        (
            Span::Hour,
            "Asia/Kathmandu",
            "2026-05-17T00:00:00Z",
            23 * MIN,
        ),
        (
            Span::Hour,
            "Europe/Berlin",
            "2026-10-24T00:00:00Z",
            23 * MIN,
        ),
        (
            Span::Minute,
            "Australia/Lord_Howe",
            "2026-04-05T14:00:00Z",
            37_000,
        ),
        (Span::Week, "UTC", "2026-12-20T00:00:00Z", 2 * 24 * H),
        (
            Span::Month,
            "Europe/Berlin",
            "2026-01-15T00:00:00Z",
            9 * 24 * H,
        ),
        // Past the zone file's last transition: the POSIX rule, computed per year.
        (Span::Day, "Europe/Berlin", "2090-03-20T00:00:00Z", 7 * H),
    ]
    .iter()
    .map(|&(span, zone, from, stride)| (window(span, zone), at(from), stride))
    .collect();
    let times = |from: i64, stride: i64| (0..400).map(move |i| from + i * stride + i % 3);
    let mut expected = Vec::with_capacity(windows.len() * 800);
    for (w, from, stride) in &windows {
        for t in times(*from, *stride) {
            expected.extend([w.bounds(t).0, w.bounds(t + 1).0]);
        }
    }
    let mut got = Vec::with_capacity(expected.len());
    let mut misses = 0;
    let before = allocations();
    for (w, from, stride) in &windows {
        let mut cache = WindowCache::default();
        for t in times(*from, *stride) {
            let start = cache.start_of(w, t);
            misses += usize::from(got.last() != Some(&start));
            // Then a hit.
            got.extend([start, cache.start_of(w, t + 1)]);
        }
    }
    assert_eq!(allocations() - before, 0, "allocations computing windows");
    assert_eq!(got, expected);
    assert!(misses > 1000, "{misses} misses");
    // Nor does the retention's cut-off.
    let before = allocations();
    let cut: i64 = windows.iter().map(|(w, from, _)| w.back(*from, 40)).sum();
    assert_eq!(allocations() - before, 0, "allocations in back");
    std::hint::black_box(cut);
}

#[test]
fn an_unknown_zone_is_named_with_where_it_was_looked_for() {
    let err = Window::new(Span::Day, "Mars/Olympus_Mons")
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("unknown time zone \"Mars/Olympus_Mons\": "),
        "{err}"
    );
    if std::env::var_os("TZDIR").is_none() {
        assert!(
            err.contains("the zone database in /usr/share/zoneinfo has no such zone"),
            "{err}"
        );
    }
    assert!(Window::new(Span::Day, "Etc/Unknown").is_err());
    assert!(Window::new(Span::Day, "").is_err());
    let none = WindowError::NoDatabase {
        zone: "Europe/Berlin".into(),
        tzdir: Some("/opt/tz".into()),
    };
    assert_eq!(
        none.to_string(),
        "unknown time zone \"Europe/Berlin\": no zone database found in TZDIR=/opt/tz, \
         /usr/share/zoneinfo, /usr/share/lib/zoneinfo, /etc/zoneinfo (install tzdata, or set \
         TZDIR to its directory)"
    );
    // Names match as the database spells them.
    assert_eq!(
        window(Span::Day, "europe/berlin").zone_name(),
        "Europe/Berlin"
    );
    assert_eq!(window(Span::Day, "UTC").zone_name(), "UTC");
}

#[test]
fn spans_nest_as_config_allows() {
    use Span::*;
    let inside: Vec<(Span, Span)> = Span::ALL
        .iter()
        .flat_map(|&a| Span::ALL.iter().map(move |&b| (a, b)))
        .filter(|&(fine, coarse)| coarse.contains(fine))
        .collect();
    assert_eq!(
        inside,
        [
            (Minute, Hour),
            (Minute, Day),
            (Minute, Week),
            (Minute, Month),
            (Hour, Day),
            (Hour, Week),
            (Hour, Month),
            (Day, Week),
            (Day, Month),
        ]
    );
}

/// A span's code is 1 + its place in `Span::ALL` (0 is the all-time row's), and is stored under
/// the span's name.
#[test]
fn span_codes_follow_span_all() {
    for (i, span) in Span::ALL.into_iter().enumerate() {
        assert_eq!(span.code(), i as SpanCode + 1);
        assert_eq!(span_name(span.code()), span.name());
    }
    assert_eq!(span_name(ALL_SPAN), "all");
}

#[test]
fn a_tzdir_without_zones_and_a_damaged_zone_file_are_reported() {
    let empty = tempfile::tempdir().unwrap();
    let err = load_zone("Europe/Berlin", Some(empty.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "TZDIR={} holds no zone database",
            empty.path().display()
        )),
        "{err}"
    );
    // UTC needs none.
    assert!(load_zone("UTC", Some(empty.path())).is_ok());
    // A database whose Berlin file is cut short: said so, with what jiff found.
    let dir = tempfile::tempdir().unwrap();
    let berlin = std::fs::read("/usr/share/zoneinfo/Europe/Berlin").unwrap();
    std::fs::create_dir(dir.path().join("Europe")).unwrap();
    std::fs::write(dir.path().join("Europe/Paris"), &berlin).unwrap();
    std::fs::write(dir.path().join("Europe/Berlin"), &berlin[..40]).unwrap();
    assert!(load_zone("Europe/Paris", Some(dir.path())).is_ok());
    let err = load_zone("Europe/Berlin", Some(dir.path()))
        .unwrap_err()
        .to_string();
    let path = dir.path().join("Europe/Berlin");
    assert!(
        err.starts_with(&format!(
            "time zone \"Europe/Berlin\": its zone file {} is damaged: ",
            path.display()
        )),
        "{err}"
    );
    // A zone the directory does not have is unknown there, not looked up elsewhere.
    let err = load_zone("Asia/Tokyo", Some(dir.path()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "the zone database in {} has no such zone",
            dir.path().display()
        )),
        "{err}"
    );
}

#[test]
fn times_whose_window_cannot_be_named_are_refused_clearly() {
    let w = window(Span::Day, "Europe/Berlin");
    assert!(nameable(0) && nameable(MAX_MS - 1) && !nameable(MAX_MS));
    assert!(!nameable(253_402_300_799_999), "9999-12-31");
    for text in [
        "9999-12-31",
        "9987-04-03",
        "9999-12-31T23:00",
        "9990-01-01T00:00:00Z",
    ] {
        let err = w.parse_instant(text).unwrap_err();
        assert!(
            err.contains("outside the windows tallyd can name"),
            "{text}: {err}"
        );
    }
    assert!(w.parse_instant("9987-03-30").is_ok());
    assert!(w.parse_instant("2026-11-25").is_ok());
}
