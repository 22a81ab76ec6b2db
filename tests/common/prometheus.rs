//! A real Prometheus server for the tests: Debian's `prometheus` binary ($PROMETHEUS, else
//! what scripts/ensure-promtool --server unpacks), scraping one tallyd every second, with
//! alert rules when a test gives them; queried over its HTTP API.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{free_port, http_get};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// $PROMETHEUS, else scripts/ensure-promtool --server; None when it cannot be had or run.
pub fn prometheus_binary() -> Option<PathBuf> {
    let path = match std::env::var_os("PROMETHEUS").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => {
            let out = Command::new(format!("{ROOT}/scripts/ensure-promtool"))
                .arg("--server")
                .stderr(Stdio::inherit())
                .output()
                .ok()?;
            if !out.status.success() {
                return None;
            }
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
    };
    let runs = Command::new(&path)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    runs.then_some(path)
}

pub struct Prometheus {
    pub addr: SocketAddr,
    child: Child,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Prometheus {
    /// Scrapes `target` every second; keeps its files in `dir`.
    pub fn start(bin: &Path, dir: &Path, target: SocketAddr) -> Prometheus {
        Prometheus::start_with_rules(bin, dir, target, None)
    }

    /// [`Prometheus::start`], evaluating the rule file `rules` every second too.
    pub fn start_with_rules(
        bin: &Path,
        dir: &Path,
        target: SocketAddr,
        rules: Option<&Path>,
    ) -> Prometheus {
        let config = dir.join("prometheus.yml");
        let rule_files = rules.map_or(String::new(), |r| {
            format!("rule_files:\n  - '{}'\n", r.display())
        });
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n{rule_files}\
                 scrape_configs:\n  - job_name: tallyd\n    static_configs:\n      \
                 - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let log = dir.join("prometheus.log");
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus { child, addr, log }
    }

    /// `/api/v1/query`: the result vector, or None while Prometheus is not ready.
    pub fn query(&self, promql: &str) -> Option<Vec<Value>> {
        // Not listening yet: not ready.
        TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).ok()?;
        let (status, body) = http_get(
            self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        );
        assert_ne!(status, 400, "query {promql} is invalid: {body}");
        if status != 200 {
            return None; // 503 while starting up
        }
        let v: Value = serde_json::from_str(&body).expect("query result is JSON");
        assert_eq!(v["status"], "success", "query {promql}: {body}");
        v["data"]["result"].as_array().cloned()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
