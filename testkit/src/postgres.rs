//! A private PostgreSQL cluster for one test, started by tallyd's own embedded module under
//! `dir/pg`: fast, and not durable against power loss (fsync off).

use std::path::Path;

use tallyd::store::embedded::{Embedded, EmbeddedOptions};

/// A private PostgreSQL under `dir/pg`. Stop it with `stop()` (its drop stops it too).
pub fn start_postgres(dir: &Path) -> Embedded {
    start_postgres_with(dir, &[])
}

/// `start_postgres` off the async threads.
pub async fn postgres(dir: &Path) -> Embedded {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || start_postgres(&dir))
        .await
        .unwrap()
}

/// Stops `pg` (a fast shutdown) off the async threads.
pub async fn stop_postgres(pg: Embedded) {
    tokio::task::spawn_blocking(move || pg.stop().expect("stop PostgreSQL"))
        .await
        .unwrap();
}

/// Stops `pg` at once (`stop_immediate`: SIGQUIT, a crash for PostgreSQL, which recovers on
/// its next start) off the async threads.
pub async fn stop_postgres_immediate(pg: Embedded) {
    tokio::task::spawn_blocking(move || pg.stop_immediate().expect("stop PostgreSQL"))
        .await
        .unwrap();
}

/// Creates the databases `db0`, `db1`, ... (`n` of them) in `pg`; returns their connection
/// strings, in order.
pub async fn create_databases(pg: &Embedded, n: usize) -> Vec<String> {
    let admin = crate::sql(&pg.connection_string("postgres")).await;
    let mut conninfos = Vec::new();
    for i in 0..n {
        let name = format!("db{i}");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        conninfos.push(pg.connection_string(&name));
    }
    conninfos
}

/// `start_postgres` with more server settings (they win over the defaults here).
pub fn start_postgres_with(dir: &Path, settings: &[(&str, &str)]) -> Embedded {
    let mut all: Vec<(String, String)> = [
        // Safe against a crash of PostgreSQL itself (the tests crash it), not of the machine.
        ("fsync", "off"),
        ("full_page_writes", "off"),
        ("max_prepared_transactions", "16"),
    ]
    .iter()
    .chain(settings)
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    all.dedup_by(|a, b| a.0 == b.0);
    Embedded::start(&EmbeddedOptions {
        dir: dir.join("pg"),
        settings: all,
        bin_dir: None,
    })
    .expect("start PostgreSQL (install it with: apt-get install -y postgresql)")
}
