//! Error messages as a user reads them from the `tallyd` binary: a database error carries the
//! server's message and SQLSTATE, or the OS error and the address tried; every cause is printed
//! exactly once.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{postgres, sql, temp_dir, TestConfig};
use tallyd::config::{Config, KeyTypeName};

/// A config in `dir` named `name` with one counter (`downloads`), changed by `edit`.
fn write_config(dir: &Path, name: &str, edit: impl FnOnce(&mut Config)) -> PathBuf {
    TestConfig::new(dir)
        .counters(&[("downloads", KeyTypeName::Text)])
        .with(edit)
        .write_as(name)
}

/// Runs a `tallyd` command that must fail; returns its stderr.
fn tallyd(config: &Path, args: &[&str]) -> String {
    let out = common::tallyd(config, args);
    assert!(!out.status.success(), "expected a failure");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn once(text: &str, cause: &str) {
    assert_eq!(
        text.matches(cause).count(),
        1,
        "{cause:?} should appear exactly once in: {text}"
    );
}

#[test]
fn a_missing_config_file_says_why_once() {
    let dir = temp_dir();
    let err = tallyd(&dir.path().join("missing.toml"), &["check-config"]);
    assert!(err.contains("cannot read config file"), "{err}");
    once(&err, "No such file or directory (os error 2)");
}

#[test]
fn an_invalid_connection_string_says_why_once() {
    let dir = temp_dir();
    let config = write_config(dir.path(), "bad.toml", |c| {
        c.database.url = "host=/tmp port=notanumber".into()
    });
    let err = tallyd(&config, &["migrate"]);
    once(&err, "invalid connection string");
    assert!(err.contains("invalid value for option `port`"), "{err}");
}

#[test]
fn a_socket_path_over_the_os_limit_says_why_once() {
    let dir = temp_dir();
    let long = dir.path().join("s".repeat(120));
    let config = write_config(dir.path(), "long.toml", |c| {
        c.database.url = "host=127.0.0.1 port=1".into();
        c.listen.set_socket(Some(long.join("tallyd.sock")));
    });
    // Refused by validation, before anything binds, naming the key once.
    let err = tallyd(&config, &["run"]);
    once(&err, "listen.socket");
    once(&err, "must be shorter than 108 bytes");
}

#[test]
fn a_metrics_port_in_use_says_why_once() {
    let dir = temp_dir();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let config = write_config(dir.path(), "port.toml", |c| {
        c.database.url = "host=127.0.0.1 port=1".into();
        c.metrics
            .set_listen(Some(taken.local_addr().unwrap().to_string()));
    });
    let err = tallyd(&config, &["run"]);
    assert!(err.contains("metrics"), "{err}");
    once(&err, "Address already in use (os error 98)");
}

/// No server on the socket directory: the address tried and the OS error, with its errno.
#[test]
fn a_connection_failure_names_the_address_and_the_os_error() {
    let dir = temp_dir();
    let config = write_config(dir.path(), "nopg.toml", |c| {
        c.database.url = format!("host={} port=5999", dir.path().display())
    });
    for command in [&["migrate"][..], &["get", "downloads", "k"]] {
        let err = tallyd(&config, command);
        let socket = format!("{}/.s.PGSQL.5999", dir.path().display());
        assert!(err.contains(&socket), "{command:?}: {err}");
        once(&err, "No such file or directory (os error 2)");
    }
    let tcp = write_config(dir.path(), "tcp.toml", |c| {
        c.database.url = "host=127.0.0.1 port=1".into()
    });
    let err = tallyd(&tcp, &["migrate"]);
    assert!(err.contains("127.0.0.1:1"), "{err}");
    once(&err, "Connection refused (os error 111)");
}

/// A server error: its message with the SQLSTATE, once.
#[tokio::test]
async fn a_server_error_carries_its_sqlstate() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let config = write_config(dir.path(), "nodb.toml", |c| {
        c.database.url = pg.connection_string("nosuchdb")
    });
    let err = tokio::task::spawn_blocking(move || tallyd(&config, &["migrate"]))
        .await
        .unwrap();
    once(
        &err,
        "database \"nosuchdb\" does not exist (SQLSTATE 3D000)",
    );
    // Detail and hint, as every log line and error with a database error prints them.
    let failed = sql(&pg.connection_string("postgres"))
        .await
        .batch_execute(
            "DO $$ BEGIN RAISE EXCEPTION 'boom' USING DETAIL = 'the detail', \
             HINT = 'the hint', ERRCODE = 'P0001'; END $$",
        )
        .await
        .unwrap_err();
    assert_eq!(
        tallyd::store::DbError::from(failed).to_string(),
        "boom (SQLSTATE P0001); detail: the detail; hint: the hint"
    );
    common::stop_postgres(pg).await;
}

/// Whether a `tallyd` command with `database.url = url` and `env` succeeded, and its stdout and
/// stderr.
fn output(url: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let dir = temp_dir();
    let config = write_config(dir.path(), "url.toml", |c| {
        c.database.url = url.into();
        c.database.set_connect_timeout(Duration::from_millis(1000));
    });
    let out = common::netpg::tallyd_cli(&config, args, env);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// [`output`] of a command that must fail.
fn failing_output(url: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let (ok, text) = output(url, args, env);
    assert!(!ok, "{args:?} with {url}: {text}");
    text
}

/// A password with a character that should have been percent-encoded (`/`, `?`), or given by a
/// percent-encoded keyword (libpq decodes keywords too), is never printed. Nothing listens on
/// port 1.
#[test]
fn no_password_in_connection_string_errors() {
    for url in [
        "postgresql://app:se/cretpw@127.0.0.1:1/db?sslmode=bogus",
        "postgresql://app:se?cretpw@127.0.0.1:1/db",
        "postgresql://app:se?cretpw@127.0.0.1:1/db?sslmode=bogus",
        "postgresql://app@127.0.0.1:1/db?pass%77ord=cretpw&sslmode=bogus",
        "postgresql://app:p@ss@cretpw@127.0.0.1:1/db?sslmode=bogus",
        "host=127.0.0.1 port=1 password=se cretpw sslmode=bogus",
    ] {
        for args in [
            &["get", "downloads", "k"][..],
            &["migrate"],
            &["check-config"],
        ] {
            // check-config accepts the strings that parse; the others fail.
            let (_, text) = output(url, args, &[]);
            assert!(
                !text.contains("cretpw"),
                "{args:?}: the password of {url} is shown: {text}"
            );
        }
    }
}

/// `check-config` refuses what every command refuses (an invalid sslmode), without connecting.
#[test]
fn check_config_rejects_an_invalid_connection_string() {
    let text = failing_output(
        "postgresql://app@127.0.0.1:1/db?sslmode=bogus",
        &["check-config"],
        &[],
    );
    once(&text, "invalid sslmode value \"bogus\"");
}

/// The hint about a running tallyd is for an `embedded` database only.
#[test]
fn get_mentions_embedded_only_for_an_embedded_database() {
    let text = failing_output(
        "postgresql://app@127.0.0.1:1/db?sslmode=disable",
        &["get", "downloads", "k"],
        &[],
    );
    assert!(!text.contains("embedded"), "{text}");
    once(&text, "Connection refused (os error 111)");
    let text = failing_output("embedded", &["get", "downloads", "k"], &[]);
    once(&text, "its PostgreSQL runs only while tallyd runs");
}

/// A failed connection names the database once, whichever command tried it.
#[test]
fn a_connection_failure_names_the_database_once() {
    for args in [&["migrate"][..], &["rollup"], &["get", "downloads", "k"]] {
        let text = failing_output("postgresql://app@127.0.0.1:1/db", args, &[]);
        once(&text, "database");
        once(
            &text,
            "cannot connect to database host=127.0.0.1 port=1 dbname=db",
        );
    }
}

/// An invalid `PGSSLMODE` is blamed on the variable, not on the connection string.
#[test]
fn an_invalid_pgsslmode_names_the_variable() {
    let text = failing_output(
        "postgresql://app@127.0.0.1:1/db",
        &["migrate"],
        &[("PGSSLMODE", "bogus")],
    );
    once(&text, "PGSSLMODE");
    once(&text, "invalid sslmode value \"bogus\"");
    assert!(!text.contains("invalid connection string"), "{text}");
}
