//! TLS to a real PostgreSQL with `ssl = on` and certificates made by the test (a private CA):
//! libpq's sslmodes, each failure named with the database and the reason, client certificates,
//! the `PGSSL*` environment variables, and the daemon counting exactly over verify-full.

mod common;

use std::time::Duration;

use common::netpg::{make_certs, net_config, tallyd_cli, TcpPostgres};
use common::{spawn_daemon, sql, temp_dir, total_and_keys, LineClient};
use tallyd::store::Db;

/// TLS only over TCP; `certuser` only with a client certificate.
const HBA_TLS_ONLY: &str = "hostssl all certuser 127.0.0.1/32 cert\n\
                            hostssl all postgres 127.0.0.1/32 trust";

fn url(host: &str, port: u16, params: &str) -> String {
    format!("postgresql://postgres@{host}:{port}/postgres?{params}")
}

async fn connect(conninfo: &str) -> Result<tokio_postgres::Client, String> {
    let db =
        Db::with_env(conninfo, Duration::from_secs(5), &|_| None).map_err(|e| e.to_string())?;
    db.connect().await.map_err(|e| e.to_string())
}

async fn uses_tls(client: &tokio_postgres::Client) -> bool {
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_daemon_counts_exactly_over_tls() {
    let dir = temp_dir();
    let certs = make_certs(dir.path());
    let pg = TcpPostgres::start(dir.path(), HBA_TLS_ONLY, Some(&certs)).await;
    let url = url(
        "localhost",
        pg.port,
        &format!("sslmode=verify-full&sslrootcert={}", certs.ca.display()),
    );
    let config = net_config(dir.path(), &url)
        .with(|c| {
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(100));
            c.flush.connections = 3;
        })
        .write();
    let socket = dir.path().join("tallyd.sock");
    let daemon = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || spawn_daemon(&config))
            .await
            .unwrap()
    };

    let mut c = LineClient::connect(&socket).await;
    let mut lines = String::new();
    for i in 0..3000 {
        lines.push_str(&format!("downloads hot\nviews k{}\n", i % 700));
    }
    c.send(lines.as_bytes()).await;
    assert_eq!(c.flush().await, (6000, 0));

    let direct = sql(&pg.pg.connection_string("postgres")).await;
    assert_eq!(total_and_keys(&direct, "downloads").await, (3000, 1));
    assert_eq!(total_and_keys(&direct, "views").await, (3000, 700));

    // Every session tallyd holds is encrypted and says whose it is.
    let id = std::fs::read_to_string(dir.path().join("data/instance_id")).unwrap();
    let rows = direct
        .query(
            "SELECT a.application_name, s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.backend_type = 'client backend' AND a.pid <> pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    assert!(!rows.is_empty(), "no tallyd sessions");
    for r in &rows {
        assert_eq!(r.get::<_, String>(0), format!("tallyd-{}", id.trim()));
        assert!(r.get::<_, bool>(1), "a session without TLS");
    }

    // The CLI goes the same way.
    let out = tallyd_cli(&config, &["get", "downloads", "hot"], &[]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("count=3000"),
        "{out:?}"
    );
    let out = tallyd_cli(&config, &["rollup", "--until-empty"], &[]);
    assert!(out.status.success(), "{out:?}");
    let out = tallyd_cli(&config, &["migrate"], &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(total_and_keys(&direct, "views").await, (3000, 700));

    assert!(tokio::task::spawn_blocking(move || daemon.terminate())
        .await
        .unwrap()
        .success());
    pg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sslmode_against_a_tls_only_server() {
    let dir = temp_dir();
    let certs = make_certs(dir.path());
    let pg = TcpPostgres::start(dir.path(), HBA_TLS_ONLY, Some(&certs)).await;
    pg.admin("CREATE ROLE certuser LOGIN").await;
    let port = pg.port;
    let ca = certs.ca.display().to_string();
    let other = certs.other_ca.display().to_string();

    // Good: verify-full on the name the certificate carries, verify-ca on any name.
    let c = connect(&url(
        "localhost",
        port,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(uses_tls(&c).await);
    let c = connect(&url(
        "127.0.0.1",
        port,
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(uses_tls(&c).await);
    // allow tries plain first, is refused by hostssl, and retries with TLS; prefer and require
    // use TLS without verifying.
    for mode in ["allow", "prefer", "require"] {
        let c = connect(&url("127.0.0.1", port, &format!("sslmode={mode}")))
            .await
            .unwrap();
        assert!(uses_tls(&c).await, "{mode}");
    }

    // Bad: each names the database and the reason, and never the password.
    let wrong_ca = connect(&format!(
        "postgresql://postgres:hunter2@localhost:{port}/postgres?sslmode=verify-ca&sslrootcert={other}"
    ))
    .await
    .unwrap_err();
    assert!(
        wrong_ca.contains(&format!(
            "host=localhost port={port} dbname=postgres user=postgres"
        )),
        "{wrong_ca}"
    );
    assert!(
        wrong_ca.contains("not signed by a CA in sslrootcert"),
        "{wrong_ca}"
    );
    assert!(!wrong_ca.contains("hunter2"), "{wrong_ca}");

    let wrong_host = connect(&url(
        "127.0.0.1",
        port,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await
    .unwrap_err();
    assert!(wrong_host.contains("host=127.0.0.1"), "{wrong_host}");
    assert!(
        wrong_host.contains("does not name this host"),
        "{wrong_host}"
    );

    let plain = connect(&url("127.0.0.1", port, "sslmode=disable"))
        .await
        .unwrap_err();
    assert!(plain.contains("host=127.0.0.1"), "{plain}");
    assert!(plain.contains("no pg_hba.conf entry"), "{plain}");
    assert!(plain.contains("accepts only TLS"), "{plain}");

    let missing = connect(&url(
        "localhost",
        port,
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.crt",
    ))
    .await
    .unwrap_err();
    assert!(
        missing.contains("/nonexistent/ca.crt") && missing.contains("does not exist"),
        "{missing}"
    );

    // Client certificates: `cert` authentication with sslcert/sslkey (key-value form here).
    let kv = format!(
        "host=localhost port={port} dbname=postgres user=certuser sslmode=verify-full \
         sslrootcert={ca} sslcert={} sslkey={}",
        certs.client_cert.display(),
        certs.client_key.display()
    );
    let c = connect(&kv).await.unwrap();
    let who: String = c
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "certuser");
    let no_cert = connect(&format!(
        "host=localhost port={port} dbname=postgres user=certuser sslmode=verify-full sslrootcert={ca}"
    ))
    .await
    .unwrap_err();
    assert!(
        no_cert.contains("user=certuser") && no_cert.contains("certificate"),
        "{no_cert}"
    );
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&certs.client_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let loose = connect(&kv).await.unwrap_err();
    assert!(loose.contains("group or world access"), "{loose}");

    // The PGSSL* environment variables, as libpq reads them, for a URL that says nothing.
    let config = net_config(
        dir.path(),
        &format!("postgresql://postgres@localhost:{port}/postgres"),
    )
    .write();
    let env_ok = [("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", ca.as_str())];
    let out = tallyd_cli(&config, &["migrate"], &env_ok);
    assert!(out.status.success(), "{out:?}");
    let env_bad = [
        ("PGSSLMODE", "verify-full"),
        ("PGSSLROOTCERT", other.as_str()),
    ];
    let out = tallyd_cli(&config, &["migrate"], &env_bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("host=localhost") && err.contains("not signed by a CA"),
        "{err}"
    );
    let out = tallyd_cli(&config, &["migrate"], &[("PGSSLMODE", "disable")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("accepts only TLS"),
        "{err}"
    );
    pg.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_server_without_tls() {
    let dir = temp_dir();
    let certs = make_certs(dir.path());
    let pg = TcpPostgres::start(dir.path(), "host all all 127.0.0.1/32 trust", None).await;
    let port = pg.port;
    let err = connect(&url("127.0.0.1", port, "sslmode=require"))
        .await
        .unwrap_err();
    assert!(
        err.contains("host=127.0.0.1") && err.contains("sslmode=require"),
        "{err}"
    );
    assert!(err.contains("server does not support TLS"), "{err}");
    let err = connect(&url(
        "localhost",
        port,
        &format!("sslmode=verify-full&sslrootcert={}", certs.ca.display()),
    ))
    .await
    .unwrap_err();
    assert!(err.contains("server does not support TLS"), "{err}");
    // prefer and allow fall back to plain text, as libpq does.
    for mode in ["prefer", "allow", "disable"] {
        let c = connect(&url("127.0.0.1", port, &format!("sslmode={mode}")))
            .await
            .unwrap();
        assert!(!uses_tls(&c).await, "{mode}");
    }
    pg.stop().await;
}
