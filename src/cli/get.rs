//! `tallyd get`: one key's exact total, from the database its logical shard lives in (or the
//! application's `rollup_into` column plus the slot rows not folded yet).

use anyhow::{bail, Context, Result};
use tokio_postgres::types::Type;

use crate::config::{Config, DatabaseConfig};
use crate::protocol::{self, Line};
use crate::routing;
use crate::store::{Databases, DbError};

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Prints `counter`'s total for `key` (canonicalised by the counter's key type, as the daemon
/// does).
pub async fn get(config: &Config, counter: &str, key: &str) -> Result<()> {
    let (counters, limits) = config.protocol();
    let line = format!("{counter} {key}");
    let key = match protocol::parse_line(line.as_bytes(), &counters, &limits) {
        Ok(Line::Event(ev)) => ev.key.as_str().to_string(),
        Ok(_) => bail!("expected a counter and a key"),
        Err(reason) => bail!("{reason}"),
    };
    // The key's logical shard picks its database.
    let hash = routing::key_hash(routing::counter_seed(counter), key.as_bytes());
    let index = config.layout().database(hash);
    let db = Databases::connect_only(config)?.swap_remove(index);
    let embedded = config.database.databases()[index] == DatabaseConfig::EMBEDDED;
    let client = match db.connect().await {
        Ok(client) => client,
        // The private cluster runs only while tallyd does.
        Err(err) if embedded => {
            return Err(err).context(format!(
                "database {index} is \"embedded\": its PostgreSQL runs only while tallyd runs"
            ))
        }
        Err(err) => return Err(err.into()),
    };
    const TS: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'";
    let declared = config.counters.iter().find(|c| c.name == counter);
    if let Some(into) = declared.and_then(|c| c.rollup_into.as_ref()) {
        // Folded counts live in the application's column; the rest is still in slots.
        let key_type: String = client
            .query_typed_one(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute \
                 WHERE attrelid = to_regclass($1) AND attname = $2",
                &[(&into.table, Type::TEXT), (&into.key_column, Type::NAME)],
            )
            .await
            .map_err(DbError::from)
            .with_context(|| format!("looking up {}.{}", into.table, into.key_column))?
            .get(0);
        let sql = format!(
            "SELECT (coalesce((SELECT {col}::numeric FROM {table} \
                     WHERE {keycol} = $2::text::{key_type}), 0) \
                  + coalesce((SELECT sum(count) FROM tallyd.slots \
                     WHERE counter = $1 AND key = $2), 0))::text",
            col = quote_ident(&into.column),
            keycol = quote_ident(&into.key_column),
            table = into
                .table
                .split('.')
                .map(quote_ident)
                .collect::<Vec<_>>()
                .join("."),
        );
        let count: String = client
            .query_typed_one(&sql, &[(&counter, Type::TEXT), (&key, Type::TEXT)])
            .await
            .map_err(DbError::from)?
            .get(0);
        println!(
            "{counter} {key} count={count} (column {}.{} plus unfolded slots)",
            into.table, into.column
        );
        return Ok(());
    }
    let row = client
        .query_typed_opt(
            &format!(
                // exact_count: `count` is NULL for a total beyond the 64-bit range.
                "SELECT exact_count::text, to_char(first_seen AT TIME ZONE 'UTC', {TS}), \
                        to_char(last_seen AT TIME ZONE 'UTC', {TS}) \
                 FROM tallyd.totals WHERE counter = $1 AND key = $2"
            ),
            &[(&counter, Type::TEXT), (&key, Type::TEXT)],
        )
        .await
        .map_err(DbError::from)?;
    match row {
        Some(r) => {
            let (count, first, last): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            println!("{counter} {key} count={count} first_seen={first} last_seen={last}");
        }
        None => println!("{counter} {key} count=0"),
    }
    Ok(())
}
