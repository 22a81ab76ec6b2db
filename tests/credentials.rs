//! Passwords as libpq takes them, against a real server with `scram-sha-256` authentication:
//! from the URL, `PGPASSWORD`, a password file (`passfile`, `PGPASSFILE`); a wrong or missing
//! one is a clear error naming the database, never the password, and `tallyd run` stops on it
//! instead of retrying without a cause. `application_name` is the user's when they set one.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::netpg::{net_config, tallyd_cli, TcpPostgres};
use common::temp_dir;
use tallyd::store::Db;

/// Has a colon and a space, which the password file and the URL must escape.
const PASSWORD: &str = "s3cret: pw";

async fn scram_server(dir: &std::path::Path) -> TcpPostgres {
    let pg = TcpPostgres::start(dir, "host all all 127.0.0.1/32 scram-sha-256", None).await;
    pg.admin(&format!(
        "CREATE ROLE app LOGIN SUPERUSER PASSWORD '{PASSWORD}'"
    ))
    .await;
    pg
}

async fn connect_with(conninfo: &str, env: &[(&str, &str)]) -> Result<String, String> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let db = Db::with_env(conninfo, Duration::from_secs(5), &lookup).map_err(|e| e.to_string())?;
    let client = db.connect().await.map_err(|e| e.to_string())?;
    let row = client
        .query_one(
            "SELECT current_user::text, current_setting('application_name')",
            &[],
        )
        .await
        .unwrap();
    Ok(format!(
        "{} {}",
        row.get::<_, String>(0),
        row.get::<_, String>(1)
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_passwords_from_url_environment_and_password_file() {
    let dir = temp_dir();
    let pg = scram_server(dir.path()).await;
    let port = pg.port;
    let base = format!("postgresql://app@127.0.0.1:{port}/postgres");

    // URL (percent-encoded), key/value (quoted), PGPASSWORD.
    let url = format!("postgresql://app:s3cret%3A%20pw@127.0.0.1:{port}/postgres");
    assert_eq!(connect_with(&url, &[]).await.unwrap(), "app tallyd");
    let kv = format!("host=127.0.0.1 port={port} dbname=postgres user=app password='{PASSWORD}' application_name=billing");
    assert_eq!(connect_with(&kv, &[]).await.unwrap(), "app billing");
    assert_eq!(
        connect_with(&base, &[("PGPASSWORD", PASSWORD), ("PGAPPNAME", "fromenv")])
            .await
            .unwrap(),
        "app fromenv"
    );

    // A wrong password: the database and the reason, not the password.
    let wrong = connect_with(
        &format!("postgresql://app:hunter2@127.0.0.1:{port}/postgres"),
        &[],
    )
    .await
    .unwrap_err();
    assert!(
        wrong.contains(&format!(
            "host=127.0.0.1 port={port} dbname=postgres user=app"
        )),
        "{wrong}"
    );
    assert!(
        wrong.contains("password authentication failed for user \"app\"")
            && wrong.contains("28P01"),
        "{wrong}"
    );
    assert!(!wrong.contains("hunter2"), "{wrong}");
    let none = connect_with(&base, &[]).await.unwrap_err();
    assert!(none.contains("none was given"), "{none}");

    // The password file: escapes, wildcards, first match; ignored when others can read it.
    let passfile = dir.path().join("pgpass");
    std::fs::write(
        &passfile,
        format!("otherhost:*:*:app:wrong\n127.0.0.1:{port}:*:app:s3cret\\: pw\n*:*:*:*:wrong\n"),
    )
    .unwrap();
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();
    let with_file = format!("{base}?passfile={}", passfile.display());
    assert_eq!(connect_with(&with_file, &[]).await.unwrap(), "app tallyd");
    let file = passfile.display().to_string();
    assert_eq!(
        connect_with(&base, &[("PGPASSFILE", &file)]).await.unwrap(),
        "app tallyd"
    );
    // ~/.pgpass by default.
    std::fs::copy(&passfile, dir.path().join(".pgpass")).unwrap();
    std::fs::set_permissions(
        dir.path().join(".pgpass"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let home = dir.path().display().to_string();
    assert_eq!(
        connect_with(&base, &[("HOME", &home)]).await.unwrap(),
        "app tallyd"
    );
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o644)).unwrap();
    let loose = connect_with(&with_file, &[]).await.unwrap_err();
    assert!(loose.contains("none was given"), "{loose}");
    std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o600)).unwrap();

    // The binary reads the same environment.
    let config = net_config(dir.path(), &base).write();
    let out = tallyd_cli(&config, &["migrate"], &[("PGPASSWORD", PASSWORD)]);
    assert!(out.status.success(), "{out:?}");
    let out = tallyd_cli(
        &config,
        &["get", "downloads", "x"],
        &[("PGPASSFILE", &file)],
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("count=0"),
        "{out:?}"
    );
    pg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_with_a_wrong_password_stops_with_the_reason() {
    let dir = temp_dir();
    let pg = scram_server(dir.path()).await;
    let url = format!("postgresql://app:hunter2@127.0.0.1:{}/postgres", pg.port);
    let config = net_config(dir.path(), &url).write();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tallyd"))
        .arg("--config")
        .arg(&config)
        .arg("run")
        .env_remove("PGPASSWORD")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A bound, not a timing assertion: a daemon that retries forever never exits.
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("tallyd run kept retrying a wrong password");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(
        err.contains("cannot connect to database host=127.0.0.1"),
        "{err}"
    );
    assert!(
        err.contains("password authentication failed for user \"app\""),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    pg.stop().await;
}
