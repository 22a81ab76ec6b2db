//! TLS to a real PostgreSQL with `ssl = on` and certificates made by the test (a private CA):
//! libpq's sslmodes, each failure named with the database and the reason, client certificates,
//! the `PGSSL*` environment variables, and the daemon counting exactly over verify-full.

mod common;

use std::path::Path;
use std::time::Duration;

use common::netpg::{make_certs, net_config, openssl, tallyd_cli, Certs, TcpPostgres};
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
    daemon_counts_exactly_over_tls(dir.path(), &pg, &url, &[]).await;
    pg.stop().await;
}

/// The daemon on `url` (rollup on, three flush connections) counts 3000 `downloads hot` and
/// 3000 `views` over 700 keys exactly, every session it holds is encrypted and says whose it
/// is, and the CLI (`get`, `rollup`, `migrate`, with `cli_env`) connects the same way.
async fn daemon_counts_exactly_over_tls(
    dir: &Path,
    pg: &TcpPostgres,
    url: &str,
    cli_env: &[(&str, &str)],
) {
    let config = net_config(dir, url)
        .with(|c| {
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(100));
            c.flush.connections = 3;
        })
        .write();
    let socket = dir.join("tallyd.sock");
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
    let id = std::fs::read_to_string(dir.join("data/instance_id")).unwrap();
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
    let out = tallyd_cli(&config, &["get", "downloads", "hot"], cli_env);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("count=3000"),
        "{out:?}"
    );
    let out = tallyd_cli(&config, &["rollup", "--until-empty"], cli_env);
    assert!(out.status.success(), "{out:?}");
    let out = tallyd_cli(&config, &["migrate"], cli_env);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(total_and_keys(&direct, "views").await, (3000, 700));

    assert!(tokio::task::spawn_blocking(move || daemon.terminate())
        .await
        .unwrap()
        .success());
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

/// TLS only for `postgres` and `scram` (a password, so SCRAM with channel binding); `plain` also
/// without TLS.
const HBA_SELF_SIGNED: &str = "hostssl all postgres 127.0.0.1/32 trust\n\
                               hostssl all scram 127.0.0.1/32 scram-sha-256\n\
                               host all plain 127.0.0.1/32 trust";

/// A self-signed certificate made in `dir` as `name.crt` and `name.key`: `key` is openssl's
/// `-newkey` argument, `ext` the extensions (none: X.509 version 1), valid for zero days
/// (notBefore = notAfter: expired at once). Returns `openssl x509 -text` of it.
fn self_signed(dir: &Path, name: &str, key: &[&str], cn: &str, ext: Option<&str>) -> String {
    let mut req = vec!["req", "-new", "-nodes", "-newkey"];
    req.extend(key);
    let (keyout, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let subj = format!("/CN={cn}");
    req.extend(["-subj", &subj, "-keyout", &keyout, "-out", &csr]);
    openssl(dir, &req);
    let mut x509 = vec![
        "x509",
        "-req",
        "-in",
        &csr,
        "-signkey",
        &keyout,
        "-days",
        "0",
        "-set_serial",
        "1",
        "-sha256",
        "-out",
        &crt,
    ];
    let extfile = format!("{name}.ext");
    if let Some(ext) = ext {
        std::fs::write(dir.join(&extfile), ext).unwrap();
        x509.extend(["-extfile", &extfile]);
    }
    openssl(dir, &x509);
    openssl(dir, &["x509", "-in", &crt, "-noout", "-text"])
}

/// Puts `name.crt`/`.key` from `dir` in place of the server's certificate and key (their owner
/// and mode stay: the key is the server's own).
fn replace_server_cert(certs: &Certs, dir: &Path, name: &str) {
    for (from, to) in [("crt", &certs.server_cert), ("key", &certs.server_key)] {
        std::fs::write(
            to,
            std::fs::read(dir.join(format!("{name}.{from}"))).unwrap(),
        )
        .unwrap();
    }
}

/// `sql` (an ALTER SYSTEM, or nothing), then `pg_reload_conf()`, and waits until a new session's
/// `pg_conf_load_time()` moved: the postmaster, which new sessions are forked from, has reloaded
/// its settings and TLS files (there is no notification of it).
async fn reload(pg: &TcpPostgres, sql: &str) {
    let admin = Db::new(&pg.pg.connection_string("postgres"), Duration::from_secs(5)).unwrap();
    let loaded = || async {
        let c = admin.connect().await.unwrap();
        let row = c
            .query_one("SELECT pg_conf_load_time()::text", &[])
            .await
            .unwrap();
        row.get::<_, String>(0)
    };
    let before = loaded().await;
    let c = admin.connect().await.unwrap();
    // Each on its own: ALTER SYSTEM refuses to run in the implicit transaction of a batch.
    for statement in [sql, "SELECT pg_reload_conf()"] {
        c.batch_execute(statement).await.unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while loaded().await == before {
        assert!(
            std::time::Instant::now() < deadline,
            "no reload after {sql}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The session's TLS protocol version, or None without TLS.
async fn tls_version(client: &tokio_postgres::Client) -> Option<String> {
    client
        .query_one(
            "SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl",
            &[],
        )
        .await
        .ok()
        .map(|row| row.get(0))
}

/// `allow`, `prefer` and `require` connect encrypted over `tls` (the server's highest version),
/// and SCRAM with channel binding required (tls-server-end-point, a hash of the certificate)
/// works.
async fn encrypted_without_verification(port: u16, tls: &str, what: &str) {
    for mode in ["allow", "prefer", "require"] {
        let c = connect(&url("127.0.0.1", port, &format!("sslmode={mode}")))
            .await
            .unwrap_or_else(|e| panic!("{what}, {tls}, sslmode={mode}: {e}"));
        assert_eq!(tls_version(&c).await.as_deref(), Some(tls), "{what} {mode}");
    }
    let c = connect(&format!(
        "postgresql://scram:pw@127.0.0.1:{port}/postgres?sslmode=require&channel_binding=require"
    ))
    .await
    .unwrap_or_else(|e| panic!("{what}, {tls}, channel binding: {e}"));
    assert_eq!(tls_version(&c).await.as_deref(), Some(tls), "{what}");
}

/// What `CREATE EXTENSION citus` gives a server without TLS (citus: enable_ssl.c), and what
/// libpq's `prefer` (the default) and `require` take without a word: a self-signed X.509
/// version 1 certificate, RSA 2048 with SHA-256, `CN=citus-auto-ssl`, valid for zero seconds.
/// tallyd takes it too in those modes, encrypted, over TLS 1.3 and 1.2, as it takes a version 3
/// certificate that no verifier would (expired, wrong name, a CA certificate as the server's,
/// an unknown critical extension); verify-ca and verify-full refuse it and say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_version_1_certificate_as_citus_makes() {
    let dir = temp_dir();
    let certs = make_certs(dir.path());
    let made = dir.path().join("made");
    std::fs::create_dir(&made).unwrap();
    let text = self_signed(&made, "citus", &["rsa:2048"], "citus-auto-ssl", None);
    assert!(text.contains("Version: 1 (0x0)"), "{text}");
    replace_server_cert(&certs, &made, "citus");
    let pg = TcpPostgres::start(dir.path(), HBA_SELF_SIGNED, Some(&certs)).await;
    let port = pg.port;

    // The daemon, on the default sslmode (prefer), and the CLI with PGSSLMODE=require.
    let default = format!("postgresql://postgres@127.0.0.1:{port}/postgres");
    daemon_counts_exactly_over_tls(dir.path(), &pg, &default, &[("PGSSLMODE", "require")]).await;

    pg.admin("CREATE ROLE scram LOGIN PASSWORD 'pw'; CREATE ROLE plain LOGIN")
        .await;
    encrypted_without_verification(port, "TLSv1.3", "version 1").await;

    // Verification refuses it, naming the database and the reason.
    let own = certs.server_cert.display().to_string();
    for mode in ["verify-ca", "verify-full"] {
        let err = connect(&format!(
            "postgresql://postgres:hunter2@127.0.0.1:{port}/postgres?sslmode={mode}&sslrootcert={own}"
        ))
        .await
        .unwrap_err();
        assert!(
            err.contains(&format!(
                "database host=127.0.0.1 port={port} dbname=postgres user=postgres (sslmode={mode})"
            )),
            "{err}"
        );
        assert!(
            err.contains("X.509 version 1 or 2") && err.contains("verifies only version 3"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }
    // prefer with a root certificate file verifies, as in libpq; when that fails it goes on
    // without TLS where pg_hba.conf lets it, and says why TLS failed where it does not.
    let c = connect(&format!(
        "postgresql://plain@127.0.0.1:{port}/postgres?sslmode=prefer&sslrootcert={own}"
    ))
    .await
    .unwrap();
    assert_eq!(tls_version(&c).await, None);
    let err = connect(&url(
        "127.0.0.1",
        port,
        &format!("sslmode=prefer&sslrootcert={own}"),
    ))
    .await
    .unwrap_err();
    assert!(
        err.contains("sslmode=prefer") && err.contains("verifies only version 3"),
        "{err}"
    );

    // TLS 1.2, whose handshake signature tallyd checks with its own candidates (tls.rs).
    reload(&pg, "ALTER SYSTEM SET ssl_max_protocol_version = 'TLSv1.2'").await;
    encrypted_without_verification(port, "TLSv1.2", "version 1").await;

    // Version 3, but nothing a verifier takes: P-256, expired, a name nobody connects to, a CA
    // certificate as the server's, an extension nobody knows marked critical.
    let text = self_signed(
        &made,
        "odd",
        &["ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"],
        "nowhere.invalid",
        Some(
            "basicConstraints=critical,CA:TRUE\n\
             subjectAltName=DNS:nowhere.invalid\n\
             1.3.6.1.4.1.99999.1=critical,ASN1:UTF8String:unknown\n",
        ),
    );
    assert!(text.contains("Version: 3 (0x2)"), "{text}");
    replace_server_cert(&certs, &made, "odd");
    reload(&pg, "").await;
    encrypted_without_verification(port, "TLSv1.2", "odd version 3").await;
    reload(&pg, "ALTER SYSTEM RESET ssl_max_protocol_version").await;
    encrypted_without_verification(port, "TLSv1.3", "odd version 3").await;
    pg.stop().await;
}
