//! tallyd's HyperLogLog sketches (src/hll.rs) against postgresql-hll itself, in a private
//! PostgreSQL with `CREATE EXTENSION hll`: the hashes equal `hll_hash_text` / `hll_hash_bytea`
//! / `hll_hash_bigint`; a sketch of a set of values is, byte for byte, what `hll_add_agg`
//! builds from the same values added in another order, for sets from 0 to 100,000 values and
//! several parameters, and its cardinality is `hll_cardinality`'s to the last bit; a union is
//! `hll_union`'s; and a sketch sent from Rust unions with one built in SQL.
//!
//! scripts/ensure-postgres installs the extension (Debian's `postgresql-<version>-hll`); where
//! it is not installed the tests say so and pass without checking anything.

mod common;

use std::error::Error;

use common::{postgres, sql, stop_postgres, temp_dir};
use tallyd::hll::{hash_bigint, hash_text, HllError, Params, Sketch};
use tallyd::store::embedded::Embedded;
use tokio_postgres::types::{to_sql_checked, FromSql, IsNull, ToSql, Type};
use tokio_postgres::Client;

/// An `hll` value on the wire: its binary form (`hll_send` / `hll_recv`) is the storage bytes.
#[derive(Debug)]
struct Hll(Vec<u8>);

impl<'a> FromSql<'a> for Hll {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Hll, Box<dyn Error + Sync + Send>> {
        Ok(Hll(raw.to_vec()))
    }

    fn accepts(ty: &Type) -> bool {
        ty.name() == "hll"
    }
}

impl ToSql for Hll {
    fn to_sql(
        &self,
        _: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        out.extend_from_slice(&self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        ty.name() == "hll"
    }

    to_sql_checked!();
}

/// A private PostgreSQL with the extension created, or `None` (said on stderr) where the
/// extension is not installed.
async fn with_extension(dir: &std::path::Path) -> Option<(Embedded, Client)> {
    let pg = postgres(dir).await;
    let client = sql(&pg.connection_string("postgres")).await;
    match client.batch_execute("CREATE EXTENSION hll").await {
        Ok(()) => Some((pg, client)),
        Err(e) => {
            let cause = e
                .as_db_error()
                .map_or(e.to_string(), |d| d.message().to_string());
            assert!(
                cause.contains("is not available") || cause.contains("control file"),
                "CREATE EXTENSION hll: {cause}"
            );
            eprintln!(
                "SKIPPED: postgresql-hll is not installed ({cause}); scripts/ensure-postgres \
                 installs it (apt-get install postgresql-<version>-hll)"
            );
            stop_postgres(pg).await;
            None
        }
    }
}

/// The parameters as `hll_add_agg`'s and `hll_empty`'s trailing arguments.
fn sql_args(p: Params) -> String {
    format!(
        "{}, {}, {}, {}",
        p.log2m(),
        p.regwidth(),
        p.expthresh(),
        u8::from(p.sparseon())
    )
}

fn params(log2m: u32, regwidth: u32, expthresh: i64, sparseon: bool) -> Params {
    Params::new(log2m, regwidth, expthresh, sparseon).unwrap()
}

/// Equal to the last bit, or both NaN (postgresql-hll's estimate is NaN past its large-range
/// cutoff with regwidth 6 and 7, src/hll.rs `estimate`; the sign of that NaN is the C
/// library's).
fn same_estimate(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// The storage type, the low 4 bits of the first byte.
fn type_name(bytes: &[u8]) -> &'static str {
    ["undefined", "empty", "explicit", "sparse", "full"][usize::from(bytes[0] & 0x0f)]
}

/// `function(v)` (an `hll_hash_*`) of each of `values`, an array of `array_type`, in order.
async fn sql_hashes(
    client: &Client,
    function: &str,
    array_type: &str,
    values: &(dyn ToSql + Sync),
) -> Vec<i64> {
    // hll_hashval has no cast to bigint, but prints as one.
    let query = format!(
        "SELECT {function}(v)::text::bigint \
         FROM unnest($1::{array_type}) WITH ORDINALITY AS t(v, i) ORDER BY i"
    );
    let rows = client.query(&query, &[values]).await.unwrap();
    rows.iter().map(|row| row.get(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hashes_are_the_extensions() {
    let dir = temp_dir();
    let Some((pg, client)) = with_extension(dir.path()).await else {
        return;
    };

    // Every tail length and a few 16-byte blocks, text beyond ASCII, spaces, long values.
    let blocks = "0123456789abcdef".repeat(3);
    let mut texts: Vec<String> = (0..=48).map(|n| blocks[..n].to_string()).collect();
    texts.extend(
        [
            "",
            " ",
            "a b\tc",
            "Grüße",
            "世界",
            "🎉🎉",
            "e\u{301}",
            "/pricing?utm=1&x=ü",
        ]
        .map(String::from),
    );
    texts.push("ü".repeat(5_000));
    texts.push("x".repeat(1_000_000));
    texts.extend((0..1000).map(|i| format!("visitor-{i}")));
    let theirs = sql_hashes(&client, "hll_hash_text", "text[]", &texts).await;
    assert_eq!(theirs.len(), texts.len());
    for (text, &theirs) in texts.iter().zip(&theirs) {
        let shown: String = text.chars().take(40).collect();
        assert_eq!(
            hash_text(text.as_bytes()),
            theirs,
            "hll_hash_text({shown:?}), {} bytes",
            text.len()
        );
    }

    // Bytes text cannot hold (NUL, invalid UTF-8): `hll_hash_bytea` hashes the same way.
    let blobs: Vec<Vec<u8>> = (0..=40u8)
        .map(|n| (0..n).map(|b| b.wrapping_mul(37) ^ 0xff).collect())
        .chain([vec![0], vec![0; 17], vec![0xff; 33]])
        .collect();
    let theirs = sql_hashes(&client, "hll_hash_bytea", "bytea[]", &blobs).await;
    assert_eq!(theirs.len(), blobs.len());
    for (blob, &theirs) in blobs.iter().zip(&theirs) {
        assert_eq!(hash_text(blob), theirs, "hll_hash_bytea({blob:?})");
    }

    let mut ints: Vec<i64> = vec![
        0,
        1,
        -1,
        2,
        i64::MIN,
        i64::MAX,
        i64::MIN + 1,
        255,
        256,
        1 << 32,
    ];
    ints.extend((0..2000).map(|i: i64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_u64 as i64)));
    let theirs = sql_hashes(&client, "hll_hash_bigint", "bigint[]", &ints).await;
    assert_eq!(theirs.len(), ints.len());
    for (&int, &theirs) in ints.iter().zip(&theirs) {
        assert_eq!(hash_bigint(int), theirs, "hll_hash_bigint({int})");
    }

    // The odd values as one sketch: the same bytes as the aggregate's.
    let row = client
        .query_one(
            "SELECT hll_add_agg(hll_hash_text(v)) FROM unnest($1::text[]) v",
            &[&texts],
        )
        .await
        .unwrap();
    let mut ours = Sketch::new(Params::default());
    for text in texts.iter().rev() {
        ours.add_hash(hash_text(text.as_bytes()));
    }
    assert_eq!(ours.to_bytes(), row.get::<_, Hll>(0).0);
    stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sketches_are_the_extensions_byte_for_byte() {
    let dir = temp_dir();
    let Some((pg, client)) = with_extension(dir.path()).await else {
        return;
    };
    // `None`: `hll_add_agg(h)` with no parameters, the extension's defaults.
    let cases: [Option<Params>; 8] = [
        None,
        Some(params(11, 5, -1, true)),
        Some(params(14, 5, -1, true)),
        Some(params(10, 4, -1, true)),
        Some(params(11, 5, 0, false)),
        Some(params(11, 5, 32, true)),
        Some(params(12, 6, -1, true)),
        Some(params(4, 1, -1, true)),
    ];
    let sizes = [0i64, 1, 5, 100, 300, 1_000, 10_000, 100_000];
    let mut seen = Vec::new();
    for case in cases {
        let p = case.unwrap_or_default();
        let args = case.map_or(String::new(), |p| format!(", {}", sql_args(p)));
        for text in [true, false] {
            for &n in &sizes {
                // SQL adds 1..=n in ascending order, tallyd in descending order.
                let (hash_sql, value): (_, fn(i64) -> i64) = if text {
                    ("hll_hash_text('visitor-' || g)", |g| {
                        hash_text(format!("visitor-{g}").as_bytes())
                    })
                } else {
                    ("hll_hash_bigint(g * 7919 - 5000000)", |g| {
                        hash_bigint(g * 7919 - 5_000_000)
                    })
                };
                let query = format!(
                    "SELECT s, coalesce(s, hll_empty({})), hll_cardinality(coalesce(s, hll_empty({0}))) \
                     FROM (SELECT hll_add_agg({hash_sql}{args}) AS s FROM generate_series(1, $1::bigint) g) t",
                    sql_args(p)
                );
                let row = client.query_one(&query, &[&n]).await.unwrap();
                let aggregate: Option<Hll> = row.get(0);
                assert_eq!(
                    aggregate.is_none(),
                    n == 0,
                    "hll_add_agg of no rows is NULL"
                );
                let theirs: Hll = row.get(1);
                let their_estimate: f64 = row.get(2);

                let mut ours = Sketch::new(p);
                for g in (1..=n).rev() {
                    ours.add_hash(value(g));
                }
                let what = format!("{p}, {n} {} values", if text { "text" } else { "bigint" });
                assert_eq!(ours.to_bytes(), theirs.0, "{what}: the bytes");
                assert!(
                    same_estimate(ours.cardinality(), their_estimate),
                    "{what}: cardinality {} but hll_cardinality {their_estimate}",
                    ours.cardinality()
                );
                // What SQL built reads back as the same sketch.
                let read = Sketch::from_bytes(&theirs.0).unwrap();
                assert_eq!(read.to_bytes(), theirs.0, "{what}: read back");
                if case.is_none() && text {
                    seen.push((n, type_name(&theirs.0)));
                }
            }
        }
    }
    // The defaults pass through every representation.
    assert_eq!(
        seen,
        [
            (0, "empty"),
            (1, "explicit"),
            (5, "explicit"),
            (100, "explicit"),
            (300, "sparse"),
            (1_000, "full"),
            (10_000, "full"),
            (100_000, "full"),
        ]
    );
    stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn union_is_hll_union() {
    let dir = temp_dir();
    let Some((pg, client)) = with_extension(dir.path()).await else {
        return;
    };
    let sketch = |p: Params, range: std::ops::Range<i64>| {
        let mut s = Sketch::new(p);
        for v in range {
            s.add_hash(hash_bigint(v));
        }
        s
    };
    // (a, b) as ranges of values: disjoint, overlapping, contained; explicit with explicit
    // (staying explicit or turning full), with sparse and with full, and full with full.
    let pairs = [
        (0..0, 0..3),
        (0..3, 0..0),
        (0..50, 25..100),
        (0..100, 100..200),
        (0..160, 0..160),
        (0..150, 150..161),
        (0..10, 0..400),
        (0..400, 300..700),
        (0..5000, 10..20),
        (0..50_000, 25_000..90_000),
    ];
    for p in [
        Params::default(),
        params(10, 4, -1, true),
        params(11, 5, 0, false),
    ] {
        for (a, b) in pairs.clone() {
            let (x, y) = (sketch(p, a.clone()), sketch(p, b.clone()));
            let mut ours = x.clone();
            ours.union(&y).unwrap();
            let row = client
                .query_one(
                    "SELECT hll_union($1, $2), \
                            hll_cardinality(hll_union($1, $2)), \
                            (SELECT hll_union_agg(s) FROM (VALUES ($2), ($1)) t(s))",
                    &[&Hll(x.to_bytes()), &Hll(y.to_bytes())],
                )
                .await
                .unwrap();
            let what = format!("{p}: {a:?} ∪ {b:?}");
            assert_eq!(ours.to_bytes(), row.get::<_, Hll>(0).0, "{what}: hll_union");
            assert!(
                same_estimate(ours.cardinality(), row.get(1)),
                "{what}: cardinality"
            );
            assert_eq!(
                ours.to_bytes(),
                row.get::<_, Hll>(2).0,
                "{what}: hll_union_agg"
            );
            // And the sketch of all values at once.
            let all = sketch(p, a.start.min(b.start)..a.end.max(b.end));
            if a.end >= b.start && b.end >= a.start || a.is_empty() || b.is_empty() {
                assert_eq!(ours.to_bytes(), all.to_bytes(), "{what}: one sketch of all");
            }
        }
    }

    // Different parameters: the extension refuses, and so does tallyd.
    let (x, y) = (
        sketch(Params::default(), 0..3),
        sketch(params(11, 5, 128, true), 0..3),
    );
    let err = client
        .query_one(
            "SELECT hll_union($1, $2)",
            &[&Hll(x.to_bytes()), &Hll(y.to_bytes())],
        )
        .await
        .unwrap_err();
    assert!(
        err.as_db_error()
            .unwrap()
            .message()
            .contains("explicit threshold does not match"),
        "{err:?}"
    );
    assert!(matches!(x.clone().union(&y), Err(HllError::Mismatch(..))));
    stop_postgres(pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sketch_sent_from_rust_unions_with_one_built_in_sql() {
    let dir = temp_dir();
    let Some((pg, client)) = with_extension(dir.path()).await else {
        return;
    };
    client
        .batch_execute(
            "CREATE TABLE page_visitors (day date, visitors hll(11, 5));
             INSERT INTO page_visitors
             SELECT '2025-03-01', hll_add_agg(hll_hash_text('visitor-' || g))
             FROM generate_series(1, 5000) g;",
        )
        .await
        .unwrap();

    // tallyd's sketches of the next days: visitors 2,501 to 7,500, then 7,000 to 7,100.
    let of = |range: std::ops::RangeInclusive<i64>| {
        let mut s = Sketch::new(Params::default());
        for g in range {
            s.add_hash(hash_text(format!("visitor-{g}").as_bytes()));
        }
        s
    };
    let (day2, day3) = (of(2501..=7500), of(7000..=7100));
    assert_eq!(type_name(&day3.to_bytes()), "explicit");
    // As a bytea: the cast to hll is a binary coercion (`CREATE CAST (bytea AS hll) WITHOUT
    // FUNCTION`), so the bytes need a `::bytea::hll`; a tokio-postgres `Vec<u8>` is not an
    // `hll` parameter.
    client
        .execute(
            "INSERT INTO page_visitors VALUES ('2025-03-02', $1::bytea::hll)",
            &[&day2.to_bytes()],
        )
        .await
        .unwrap();
    let err = client
        .execute(
            "INSERT INTO page_visitors VALUES ('2025-03-03', $1::hll)",
            &[&day3.to_bytes()],
        )
        .await
        .unwrap_err();
    let cause = err.source().map(ToString::to_string).unwrap_or_default();
    assert!(
        cause.contains("cannot convert") && cause.contains("hll"),
        "{err}: {cause}"
    );
    // In the binary format an `hll` parameter is the same bytes (`hll_recv` is `bytearecv`).
    client
        .execute(
            "INSERT INTO page_visitors VALUES ('2025-03-03', $1)",
            &[&Hll(day3.to_bytes())],
        )
        .await
        .unwrap();

    let row = client
        .query_one(
            "SELECT hll_union_agg(visitors), hll_cardinality(hll_union_agg(visitors)), \
                    (SELECT visitors FROM page_visitors WHERE day = '2025-03-01') \
             FROM page_visitors",
            &[],
        )
        .await
        .unwrap();
    let mut ours = Sketch::from_bytes(&row.get::<_, Hll>(2).0).unwrap();
    ours.union(&day2).unwrap();
    ours.union(&day3).unwrap();
    assert_eq!(
        ours.to_bytes(),
        row.get::<_, Hll>(0).0,
        "the three days' union"
    );
    assert_eq!(ours.cardinality(), row.get::<_, f64>(1));
    assert_eq!(
        ours.to_bytes(),
        of(1..=7500).to_bytes(),
        "the sketch of every visitor"
    );
    let estimate = ours.cardinality();
    assert!(
        (estimate - 7500.0).abs() < 7500.0 * 3.0 * 0.023,
        "{estimate}"
    );

    // The bytea cast checks nothing: bytes that are no sketch pass it, and are refused when
    // read, by the extension and by tallyd alike; a column with a type modifier (`hll(11, 5)`)
    // reads them at the insert, through the `hll(hll, integer, boolean)` cast.
    let junk = vec![0x99u8, 0x8b, 0x7f];
    let row = client
        .query_one("SELECT $1::bytea::hll IS NOT NULL", &[&junk])
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    for statement in [
        "SELECT hll_cardinality($1::bytea::hll)",
        "INSERT INTO page_visitors VALUES ('2025-03-04', $1::bytea::hll)",
    ] {
        let err = client.execute(statement, &[&junk]).await.unwrap_err();
        assert!(
            err.as_db_error()
                .unwrap()
                .message()
                .contains("unknown schema version 9"),
            "{statement}: {err:?}"
        );
    }
    assert_eq!(
        Sketch::from_bytes(&[0x99, 0x8b, 0x7f]),
        Err(HllError::Version(9))
    );
    stop_postgres(pg).await;
}
