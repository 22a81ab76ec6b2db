//! Error messages as a user reads them from the `tallyd` binary: a database error carries the
//! server's message and SQLSTATE, or the OS error and the address tried; every cause is printed
//! exactly once.

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{postgres, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_tallyd");

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    let text = format!(
        "[daemon]\ndata_dir = \"{dir}/data\"\n{text}\n[[counters]]\nname = \"downloads\"\n",
        dir = dir.display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn tallyd(config: &Path, args: &[&str]) -> String {
    let out: Output = Command::new(BIN)
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("run tallyd");
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
    let config = write_config(
        dir.path(),
        "bad.toml",
        "[database]\nurl = \"host=/tmp port=notanumber\"",
    );
    let err = tallyd(&config, &["migrate"]);
    once(&err, "invalid connection string");
    assert!(err.contains("invalid value for option `port`"), "{err}");
}

#[test]
fn a_socket_path_over_the_os_limit_says_why_once() {
    let dir = temp_dir();
    let long = dir.path().join("s".repeat(120));
    let config = write_config(
        dir.path(),
        "long.toml",
        &format!(
            "[database]\nurl = \"host=127.0.0.1 port=1\"\n[listen]\nsocket = \"{}/tallyd.sock\"\n\
             [metrics]\nlisten = \"\"",
            long.display()
        ),
    );
    let err = tallyd(&config, &["run"]);
    once(&err, "path must be shorter than SUN_LEN");
}

#[test]
fn a_metrics_port_in_use_says_why_once() {
    let dir = temp_dir();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let config = write_config(
        dir.path(),
        "port.toml",
        &format!(
            "[database]\nurl = \"host=127.0.0.1 port=1\"\n[listen]\nsocket = \"{dir}/t.sock\"\n\
             datagram_socket = \"{dir}/t.dgram\"\n[metrics]\nlisten = \"{}\"",
            taken.local_addr().unwrap(),
            dir = dir.path().display()
        ),
    );
    let err = tallyd(&config, &["run"]);
    assert!(err.contains("metrics"), "{err}");
    once(&err, "Address already in use (os error 98)");
}

/// No server on the socket directory: the address tried and the OS error, with its errno.
#[test]
fn a_connection_failure_names_the_address_and_the_os_error() {
    let dir = temp_dir();
    let config = write_config(
        dir.path(),
        "nopg.toml",
        &format!(
            "[database]\nurl = \"host={} port=5999\"",
            dir.path().display()
        ),
    );
    for command in [&["migrate"][..], &["get", "downloads", "k"]] {
        let err = tallyd(&config, command);
        let socket = format!("{}/.s.PGSQL.5999", dir.path().display());
        assert!(err.contains(&socket), "{command:?}: {err}");
        once(&err, "No such file or directory (os error 2)");
    }
    let tcp = write_config(
        dir.path(),
        "tcp.toml",
        "[database]\nurl = \"host=127.0.0.1 port=1\"",
    );
    let err = tallyd(&tcp, &["migrate"]);
    assert!(err.contains("127.0.0.1:1"), "{err}");
    once(&err, "Connection refused (os error 111)");
}

/// A server error: its message with the SQLSTATE, once.
#[tokio::test]
async fn a_server_error_carries_its_sqlstate() {
    let dir = temp_dir();
    let pg = postgres(dir.path()).await;
    let config = write_config(
        dir.path(),
        "nodb.toml",
        &format!("[database]\nurl = \"{}\"", pg.connection_string("nosuchdb")),
    );
    let err = tokio::task::spawn_blocking(move || tallyd(&config, &["migrate"]))
        .await
        .unwrap();
    once(
        &err,
        "database \"nosuchdb\" does not exist (SQLSTATE 3D000)",
    );
    // Detail and hint, as every log line and error with a database error prints them.
    let db = tallyd::store::Db::new(
        &pg.connection_string("postgres"),
        std::time::Duration::from_secs(5),
    )
    .unwrap();
    let failed = db
        .connect()
        .await
        .unwrap()
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
    tokio::task::spawn_blocking(move || pg.stop().unwrap())
        .await
        .unwrap();
}
