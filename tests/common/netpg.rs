//! PostgreSQL as production runs it, for the connection tests: a private cluster listening on
//! 127.0.0.1 with a free port, TLS with certificates made here by the `openssl` CLI (a private
//! CA), a pg_hba.conf of the test's choosing, and Debian's PgBouncer in front of a cluster.
//! PostgreSQL and PgBouncer run as the `postgres` OS user (the tests run as root).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tallyd::config::KeyTypeName;
use tallyd::store::embedded::Embedded;

use super::{db, free_port, start_postgres_with, Harness, TestConfig};

/// (uid, gid) of the `postgres` OS user.
pub fn postgres_ids() -> (u32, u32) {
    let name = std::ffi::CString::new("postgres").unwrap();
    // SAFETY: getpwnam returns a pointer to static storage or null; read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "no postgres OS user");
    // SAFETY: checked non-null above.
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

fn chown_postgres(path: &Path) {
    let (uid, gid) = postgres_ids();
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

/// Certificates for one test: a CA, an unrelated CA, a server certificate for `localhost` only
/// (so that 127.0.0.1 is a wrong host name for verify-full), a client certificate for the user
/// `certuser`.
pub struct Certs {
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// Runs `openssl args` in `dir`; panics with its stderr if it fails. Returns its stdout.
pub fn openssl(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl (apt-get install -y openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
    );
}

fn make_leaf(dir: &Path, name: &str, cn: &str, ext: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            &format!("{name}.crt"),
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}

pub fn make_certs(dir: &Path) -> Certs {
    let dir = dir.join("certs");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    make_ca(&dir, "ca");
    make_ca(&dir, "other");
    make_leaf(
        &dir,
        "server",
        "localhost",
        "basicConstraints=CA:FALSE\nsubjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    make_leaf(
        &dir,
        "client",
        "certuser",
        "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n",
    );
    // PostgreSQL wants its key private to the user it runs as; libpq and tallyd want the same
    // of a client key.
    let key = dir.join("server.key");
    chown_postgres(&key);
    for k in [&key, &dir.join("client.key")] {
        std::fs::set_permissions(k, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    for f in ["ca.crt", "other.crt", "server.crt", "client.crt"] {
        std::fs::set_permissions(dir.join(f), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    Certs {
        ca: dir.join("ca.crt"),
        other_ca: dir.join("other.crt"),
        server_cert: dir.join("server.crt"),
        server_key: key,
        client_cert: dir.join("client.crt"),
        client_key: dir.join("client.key"),
    }
}

/// A private cluster on 127.0.0.1:`port` (and its Unix socket, trusted, for the test's own SQL),
/// with `hba` as pg_hba.conf and TLS on when `certs` are given.
pub struct TcpPostgres {
    pub pg: Embedded,
    pub port: u16,
}

impl TcpPostgres {
    pub async fn start(dir: &Path, hba: &str, certs: Option<&Certs>) -> TcpPostgres {
        let port = free_port();
        let hba_file = dir.join("pg_hba.conf");
        std::fs::write(&hba_file, format!("local all all trust\n{hba}\n")).unwrap();
        std::fs::set_permissions(&hba_file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut settings: Vec<(String, String)> = vec![
            ("listen_addresses".into(), "127.0.0.1".into()),
            ("port".into(), port.to_string()),
            ("hba_file".into(), hba_file.display().to_string()),
            ("password_encryption".into(), "scram-sha-256".into()),
        ];
        if let Some(c) = certs {
            settings.extend([
                ("ssl".into(), "on".into()),
                ("ssl_cert_file".into(), c.server_cert.display().to_string()),
                ("ssl_key_file".into(), c.server_key.display().to_string()),
                ("ssl_ca_file".into(), c.ca.display().to_string()),
            ]);
        }
        let dir = dir.to_path_buf();
        let pg = tokio::task::spawn_blocking(move || {
            let refs: Vec<(&str, &str)> = settings
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            start_postgres_with(&dir, &refs)
        })
        .await
        .unwrap();
        TcpPostgres { pg, port }
    }

    /// SQL as the superuser over the trusted Unix socket.
    pub async fn admin(&self, sql: &str) {
        let db = tallyd::store::Db::new(
            &self.pg.connection_string("postgres"),
            Duration::from_secs(5),
        )
        .unwrap();
        let client = db.connect().await.expect("admin connection");
        client.batch_execute(sql).await.expect("admin SQL");
    }

    pub async fn stop(self) {
        let pg = self.pg;
        super::stop_postgres(pg).await;
    }
}

/// PgBouncer in `pool_mode` in front of `pg` (over its Unix socket), listening on 127.0.0.1
/// with trust authentication for `postgres`, and only `pool_size` server connections, so that
/// tallyd's sessions must share them.
/// The lines of `pg`'s server log where a statement met another session's through a
/// transaction pooler: a named prepared statement or portal that "already exists" or "does not
/// exist" on a shared server connection (tallyd would only show them as retries).
pub fn statements_crossed_in_the_pooler(pg: &Embedded) -> Vec<String> {
    std::fs::read_to_string(pg.log_path())
        .unwrap()
        .lines()
        .filter(|l| l.contains("prepared statement") || l.contains("portal"))
        .map(String::from)
        .collect()
}

pub struct Pgbouncer {
    child: Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Pgbouncer {
    pub fn start(dir: &Path, pg: &Embedded, pool_mode: &str, pool_size: u32) -> Pgbouncer {
        let bin = std::env::var("PGBOUNCER").unwrap_or_else(|_| "/usr/sbin/pgbouncer".into());
        assert!(
            Path::new(&bin).exists(),
            "PgBouncer not found at {bin}: run scripts/ensure-pgbouncer (or scripts/test), or set PGBOUNCER"
        );
        let dir = dir.join("pgbouncer");
        std::fs::create_dir_all(&dir).unwrap();
        chown_postgres(&dir);
        let port = free_port();
        let socket = pg.socket_dir().display().to_string();
        let pg_port = pg
            .connection_string("postgres")
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("port=").map(str::to_string))
            .unwrap();
        std::fs::write(dir.join("userlist.txt"), "\"postgres\" \"\"\n").unwrap();
        let log = dir.join("pgbouncer.log");
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 * = host={socket} port={pg_port}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {users}\n\
                 pool_mode = {pool_mode}\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 200\n\
                 logfile = {log}\n\
                 admin_users = postgres\n",
                users = dir.join("userlist.txt").display(),
                log = log.display(),
            ),
        )
        .unwrap();
        let (uid, gid) = postgres_ids();
        let mut child = Command::new(&bin)
            .arg(&ini)
            .uid(uid)
            .gid(gid)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "pgbouncer exited: {status}\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "pgbouncer did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
        Pgbouncer { child, port, log }
    }

    /// PgBouncer in `pool_mode` in front of `h`'s PostgreSQL, `h`'s daemon restarted through
    /// it: its start migrates, checks the shard map and replays the ledger through the pooler.
    pub async fn in_front_of(h: &mut Harness, pool_mode: &str, pool_size: u32) -> Pgbouncer {
        let bouncer = Pgbouncer::start(h.dir.path(), h.pg.as_ref().unwrap(), pool_mode, pool_size);
        h.stop_daemon().await;
        h.db = db(&bouncer.url());
        h.start_daemon().await;
        bouncer
    }

    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// Any database of the cluster behind (PgBouncer's `*` entry).
    pub fn url_for(&self, dbname: &str) -> String {
        format!(
            "postgresql://postgres@127.0.0.1:{}/{dbname}?sslmode=disable",
            self.port
        )
    }
}

impl Drop for Pgbouncer {
    fn drop(&mut self) {
        // SAFETY: a plain kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// The `tallyd` binary with `args`, an environment of its own (`PG*` variables for the test),
/// and no inherited `PG*` variables.
pub fn tallyd_cli(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tallyd"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("PG")) {
        cmd.env_remove(k);
    }
    cmd.arg("--config")
        .arg(config)
        .args(args)
        .envs(env.iter().copied());
    cmd.output().expect("run tallyd")
}

/// The config the connection tests give the binary: the test kit's paths under `dir`, `url` as
/// the database, two text counters (`downloads`, `views`), quick flushes and retries, no rollup
/// schedule. Callers edit the `Config` with `.with(..)` and `.write()` it.
pub fn net_config(dir: &Path, url: &str) -> TestConfig {
    TestConfig::new(dir)
        .counters(&[
            ("downloads", KeyTypeName::Text),
            ("views", KeyTypeName::Text),
        ])
        .database_url(url)
        .with(|c| {
            c.database.set_connect_timeout(Duration::from_millis(5000));
            c.flush.set_interval(Duration::from_millis(100));
            c.flush.set_retry_initial(Duration::from_millis(20));
            c.flush.set_retry_max(Duration::from_millis(300));
            c.rollup.enabled = false;
        })
}
