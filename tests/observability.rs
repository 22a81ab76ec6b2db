//! Observability, checked against the real `tallyd run` binary: the /metrics scrape has exact
//! values and passes `promtool check metrics`; the dashboard (dashboards/tallyd.json) only uses
//! metrics the daemon exports and only valid PromQL; the alert rules load; and, with the
//! `prometheus` server binary, the dashboard's main queries return data from a real scrape.
//!
//! promtool comes from $PROMTOOL, else from scripts/ensure-promtool (scripts/test exports both
//! PROMTOOL and PROMETHEUS). Without promtool these tests fail: CI installs it.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::prometheus::{prometheus_binary, Prometheus};
use common::{free_port, temp_dir, Samples, TestConfig};
use serde_json::Value;
use tallyd::config::{Config, KeyTypeName};

mod common;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

// ---------------------------------------------------------------------------------------------
// The daemon

/// `tallyd run` (the kit's child daemon) with the observability test config, stopped with
/// SIGTERM when dropped (so that the private PostgreSQL stops too, even when a test fails).
struct Daemon {
    child: Option<common::Daemon>,
    config: PathBuf,
    socket: PathBuf,
    datagram: PathBuf,
    metrics: SocketAddr,
}

/// The private PostgreSQL without durability, quick flushes, a rollup every 100 ms, the metrics
/// endpoint on `port`, `downloads` (text) and `ips` (inet).
fn obs_config(dir: &Path, port: u16) -> TestConfig {
    TestConfig::new(dir)
        .counters(&[("downloads", KeyTypeName::Text), ("ips", KeyTypeName::Inet)])
        .fast()
        .metrics_port(port)
        .with(|c| {
            for setting in ["synchronous_commit", "full_page_writes"] {
                let off = "off".to_string();
                c.database.embedded_settings.insert(setting.into(), off);
            }
            c.rollup.enabled = true;
            c.rollup.set_interval(Duration::from_millis(100));
        })
}

/// Starts `tallyd run` with the test config changed by `edit` and waits until its socket
/// answers `!ping` (the metrics endpoint is up before that).
fn spawn_daemon(dir: &Path, edit: impl FnOnce(&mut Config)) -> Daemon {
    let port = free_port();
    let config = obs_config(dir, port).with(edit).write();
    let child = common::spawn_daemon(&config);
    Daemon {
        socket: child.socket().to_path_buf(),
        child: Some(child),
        config,
        datagram: dir.join("tallyd.dgram"),
        metrics: SocketAddr::from(([127, 0, 0, 1], port)),
    }
}

/// Sends `lines` on a new stream connection to `socket` followed by `!flush`; returns the reply.
fn send_lines(socket: &Path, lines: &str) -> std::io::Result<String> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(lines.as_bytes())?;
    s.write_all(b"!flush\n")?;
    let mut reply = String::new();
    BufReader::new(&s).read_line(&mut reply)?;
    Ok(reply)
}

impl Daemon {
    /// Sends `lines` on a new stream connection followed by `!flush`; returns the reply
    /// (`ok <accepted> <rejected>`) once the events are committed.
    fn send(&self, lines: &str) -> String {
        send_lines(&self.socket, lines).expect("send to tallyd")
    }

    fn send_datagram(&self, payload: &[u8]) {
        let s = UnixDatagram::unbound().unwrap();
        s.send_to(payload, &self.datagram).expect("send datagram");
    }

    fn scrape(&self) -> String {
        common::scrape(self.metrics)
    }

    /// Scrapes until `done` holds for the parsed samples, for at most 30 s.
    fn scrape_until(&self, what: &str, done: impl Fn(&Samples) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let text = self.scrape();
            if done(&Samples::parse(&text)) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "waiting for {what}; last scrape:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            let status = child.terminate();
            assert!(
                status.success() || std::thread::panicking(),
                "tallyd exited with {status}"
            );
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP, scrape parsing, promtool

static PROMTOOL: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// $PROMTOOL, else what scripts/ensure-promtool prints (it downloads promtool when missing).
fn promtool() -> PathBuf {
    let found = PROMTOOL.get_or_init(|| {
        if let Some(p) = std::env::var_os("PROMTOOL").filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p));
        }
        let out = Command::new(format!("{ROOT}/scripts/ensure-promtool"))
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("cannot run scripts/ensure-promtool: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(PathBuf::from(
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        ))
    });
    match found {
        Ok(p) => p.clone(),
        Err(e) => panic!(
            "promtool is required (set PROMTOOL, or let scripts/ensure-promtool download it):\n{e}"
        ),
    }
}

/// Runs promtool with `args`, feeding `stdin`; returns (success, stdout + stderr).
fn run_promtool(args: &[&str], stdin: &str) -> (bool, String) {
    let mut child = Command::new(promtool())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Every family in the scrape has HELP and TYPE, and promtool's linter accepts it.
fn check_scrape(scrape: &str) {
    let mut help = BTreeSet::new();
    let mut typed = BTreeSet::new();
    for line in scrape.lines() {
        let mut f = line.split(' ');
        match (f.next(), f.next(), f.next()) {
            (Some("#"), Some("HELP"), Some(name)) => {
                help.insert(name);
            }
            (Some("#"), Some("TYPE"), Some(name)) => {
                typed.insert(name);
            }
            _ => {}
        }
    }
    let no_help: Vec<_> = typed.difference(&help).collect();
    assert!(no_help.is_empty(), "metrics without HELP: {no_help:?}");
    for name in Samples::parse(scrape).names().clone() {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(f)))
            .unwrap_or(&name);
        assert!(typed.contains(family), "{name} has no TYPE line");
    }
    let (ok, out) = run_promtool(&["check", "metrics"], scrape);
    assert!(
        ok,
        "promtool check metrics failed:\n{out}\n--- scrape:\n{scrape}"
    );
}

// ---------------------------------------------------------------------------------------------
// The dashboard

fn dashboard() -> Value {
    let text = std::fs::read_to_string(format!("{ROOT}/dashboards/tallyd.json")).unwrap();
    serde_json::from_str(&text).expect("dashboards/tallyd.json is JSON")
}

/// Every panel, rows' nested panels included.
fn panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(nested) = p["panels"].as_array() {
            out.extend(nested);
        }
    }
    out
}

/// (panel title, expr) of every query.
fn exprs(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in panels(dash) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("").to_string();
            out.push((title, t["expr"].as_str().expect("expr").to_string()));
        }
    }
    out
}

/// The query as Prometheus would get it from Grafana.
fn substitute(expr: &str, rate_interval: &str) -> String {
    let e = expr
        .replace("$__rate_interval", rate_interval)
        .replace("${instance}", ".*")
        .replace("$instance", ".*");
    assert!(!e.contains('$'), "unsubstituted variable in {expr:?}");
    e
}

/// Every `tallyd_...` identifier in `text`, with the byte offset just after it.
fn metric_names(text: &str) -> Vec<(String, usize)> {
    let b = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("tallyd_").map(|p| p + i) {
        let mut end = at;
        while end < b.len() && ident(b[end]) {
            end += 1;
        }
        if at == 0 || !ident(b[at - 1]) {
            out.push((text[at..end].to_string(), end));
        }
        i = end;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn scrape_has_exact_values_and_passes_promtool() {
    // Fail early, before starting anything, when promtool cannot be had.
    promtool();
    let dir = temp_dir();
    let daemon = spawn_daemon(dir.path(), |_| {});

    let stream = "downloads a\ndownloads a\ndownloads b 5\nnope x\nips 10.0.0.1\n";
    assert_eq!(daemon.send(stream), "ok 4 1\n");
    let datagram = b"downloads c\nips 10.0.0.2\n";
    daemon.send_datagram(datagram);

    // The datagram is committed by a timed flush: wait for it, then everything is exact.
    let text = daemon.scrape_until("the datagram's events to be committed", |s| {
        s.get("tallyd_flush_events_total") == Some(6.0)
            && s.get("tallyd_pending_keys") == Some(0.0)
            && s.get("tallyd_pending_events") == Some(0.0)
    });
    let s = Samples::parse(&text);
    let v = |series: &str| s.value(series);
    assert_eq!(
        v(r#"tallyd_events_accepted_total{counter="downloads"}"#),
        4.0
    );
    assert_eq!(v(r#"tallyd_events_accepted_total{counter="ips"}"#), 2.0);
    assert_eq!(
        v(r#"tallyd_lines_rejected_total{reason="unknown_counter"}"#),
        1.0
    );
    for reason in [
        "bad_key",
        "missing_key",
        "too_long",
        "unknown_command",
        "overflow",
    ] {
        let series = format!(r#"tallyd_lines_rejected_total{{reason="{reason}"}}"#);
        assert_eq!(v(&series), 0.0, "{series} exported at 0");
    }
    assert_eq!(v("tallyd_datagrams_received_total"), 1.0);
    // spawn_daemon's `!ping` connection and ours.
    assert_eq!(v("tallyd_connections_accepted_total"), 2.0);
    for reason in ["max_connections", "descriptors"] {
        let series = format!(r#"tallyd_connections_refused_total{{reason="{reason}"}}"#);
        assert_eq!(v(&series), 0.0, "{series} exported at 0");
    }
    let bytes = "!ping\n".len() + stream.len() + "!flush\n".len() + datagram.len();
    assert_eq!(v("tallyd_received_bytes_total"), bytes as f64);
    assert_eq!(v("tallyd_flush_events_total"), 6.0);
    // 5 distinct keys; the two `downloads a` may land in two flushes.
    let rows = v("tallyd_flush_rows_total");
    assert!((5.0..=6.0).contains(&rows), "flush rows {rows}");
    let flushes = v("tallyd_flushes_total");
    assert!(flushes >= 1.0);
    assert_eq!(v("tallyd_flush_duration_seconds_count"), flushes);
    assert_eq!(v("tallyd_event_to_commit_seconds_count"), flushes);
    assert_eq!(
        v(r#"tallyd_event_to_commit_seconds_bucket{le="+Inf"}"#),
        flushes
    );
    assert_eq!(v("tallyd_flush_errors_total"), 0.0);
    assert_eq!(v("tallyd_flush_retries_total"), 0.0);
    assert_eq!(v(r#"tallyd_database_up{database="0"}"#), 1.0);
    assert_eq!(v("tallyd_backpressure_pause_seconds_count"), 0.0);
    assert_eq!(v("tallyd_backpressure_pause_seconds_sum"), 0.0);
    assert_eq!(v("tallyd_rollup_errors_total"), 0.0);
    assert_eq!(v("tallyd_journal_errors_total"), 0.0);
    assert_eq!(v("tallyd_journal_replayed_events_total"), 0.0);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        v(&format!(r#"tallyd_build_info{{version="{version}"}}"#)),
        1.0
    );
    assert!(v("tallyd_process_resident_memory_bytes") > 1e6);
    assert!(v("tallyd_process_open_fds") >= 3.0);
    assert!(v("tallyd_process_threads") >= 1.0);
    let started = v("tallyd_process_start_time_seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        (now - 600.0..=now + 5.0).contains(&started),
        "start time {started}"
    );
    assert!(s.get("tallyd_process_cpu_seconds_total").is_some());
    // The removed pair is gone for good.
    assert!(!text.contains("tallyd_backpressure_pauses_total"));
    assert!(!text.contains("tallyd_backpressure_seconds_total"));

    check_scrape(&text);
}

/// Creates the application table the `repo_downloads` counter rolls up into, on the private
/// PostgreSQL of a running daemon.
fn create_repositories(config: &Path) {
    common::run_sql(
        config,
        "CREATE TABLE public.repositories (id bigint PRIMARY KEY, download_count bigint);
         INSERT INTO public.repositories VALUES (1, 0);",
    );
}

/// Every metric name the dashboard (queries and templating) and the alert rules use.
fn referenced_metrics(dash: &Value) -> BTreeSet<String> {
    let mut referenced = BTreeSet::new();
    for (_, expr) in &exprs(dash) {
        referenced.extend(metric_names(expr).into_iter().map(|(n, _)| n));
    }
    let templating = serde_json::to_string(&dash["templating"]).unwrap();
    referenced.extend(metric_names(&templating).into_iter().map(|(n, _)| n));
    let alerts = std::fs::read_to_string(format!("{ROOT}/dashboards/alerts.yml")).unwrap();
    referenced.extend(metric_names(&alerts).into_iter().map(|(n, _)| n));
    referenced
}

/// Before any event, every labelled series whose label values the config gives (per counter,
/// per database) is in the scrape at its starting value, and so is every metric the dashboard
/// and the alerts use: an alert on a series that does not exist yet can never fire. With two
/// databases, each has its own `tallyd_database_up`.
#[test]
fn labelled_series_exist_before_any_event() {
    promtool();
    let dir = temp_dir();
    // No counter uses rollup_into.
    let daemon = spawn_daemon(dir.path(), |c| {
        c.database.shards = vec!["embedded".into(); 2]
    });
    // The first rollup tick sets tallyd_slot_rows (an estimate; absent until it is known).
    let text = daemon.scrape_until("the first rollup tick", |s| {
        s.get(r#"tallyd_slot_rows{database="0"}"#).is_some()
            && s.get(r#"tallyd_slot_rows{database="1"}"#).is_some()
    });
    let s = Samples::parse(&text);
    for counter in ["downloads", "ips"] {
        for series in [
            format!(r#"tallyd_rollup_unmatched_keys{{counter="{counter}",database="0"}}"#),
            format!(r#"tallyd_rollup_unmatched_keys{{counter="{counter}",database="1"}}"#),
            format!(r#"tallyd_events_accepted_total{{counter="{counter}"}}"#),
            format!(r#"tallyd_rollup_overflow_keys{{counter="{counter}",database="0"}}"#),
            format!(r#"tallyd_rollup_overflow_keys{{counter="{counter}",database="1"}}"#),
        ] {
            assert_eq!(s.value(&series), 0.0, "{series}");
        }
    }
    for database in ["0", "1"] {
        let series = format!(r#"tallyd_database_up{{database="{database}"}}"#);
        assert_eq!(s.value(&series), 1.0, "{series}");
    }
    assert_eq!(s.get("tallyd_database_up"), None, "no unlabelled series");
    let missing: Vec<String> = referenced_metrics(&dashboard())
        .difference(s.names())
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "dashboard/alerts use series absent before the first event: {missing:?}\n{text}"
    );
    check_scrape(&text);

    // Two client lines take a key beyond the 64-bit range after a rollup: the rollup holds that
    // key back, says so, and goes on folding the others.
    assert_eq!(
        daemon.send(&format!("downloads huge {}\n", i64::MAX)),
        "ok 1 0\n"
    );
    daemon.scrape_until("the total at the limit to be folded", |s| {
        s.get("tallyd_rollup_rows_total") >= Some(1.0)
    });
    assert_eq!(daemon.send("downloads huge 1\nips 10.0.0.9\n"), "ok 2 0\n");
    let overflow = |s: &Samples| {
        ["0", "1"]
            .iter()
            .map(|d| {
                s.value(&format!(
                    r#"tallyd_rollup_overflow_keys{{counter="downloads",database="{d}"}}"#
                ))
            })
            .sum::<f64>()
    };
    let text = daemon.scrape_until("the held-back key and the other key folded", |s| {
        overflow(s) == 1.0 && s.get("tallyd_rollup_rows_total") >= Some(2.0)
    });
    let s = Samples::parse(&text);
    assert_eq!(s.value("tallyd_rollup_errors_total"), 0.0);
    assert_eq!(
        s.value(r#"tallyd_rollup_overflow_keys{counter="ips",database="0"}"#)
            + s.value(r#"tallyd_rollup_overflow_keys{counter="ips",database="1"}"#),
        0.0
    );
    // The gauge is set just before the line is logged, and the log is written by a background
    // thread: the line may land a moment after the scrape that saw the gauge.
    let log_path = daemon.config.with_extension("log");
    let mut log = String::new();
    for _ in 0..200 {
        log = std::fs::read_to_string(&log_path).unwrap();
        if log.contains("rollup holds back keys") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let line = log
        .lines()
        .find(|l| l.contains("rollup holds back keys"))
        .unwrap_or_else(|| panic!("no log line for the held-back key:\n{log}"));
    assert!(
        line.contains("downloads") && line.contains("huge"),
        "{line}"
    );
}

#[test]
fn dashboard_and_alerts_use_exported_metrics_and_valid_promql() {
    promtool();
    let dash = dashboard();

    // Importable and file-provisionable: a datasource variable, no __inputs.
    let raw = std::fs::read_to_string(format!("{ROOT}/dashboards/tallyd.json")).unwrap();
    assert!(dash.get("__inputs").is_none(), "no __inputs");
    assert!(!raw.contains("${DS_"), "no ${{DS_...}} inputs");
    assert!(dash["schemaVersion"].as_u64().unwrap() >= 36);
    let vars = dash["templating"]["list"].as_array().unwrap();
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    let instance = var("instance");
    assert_eq!(
        instance["definition"],
        "label_values(tallyd_build_info, instance)"
    );
    let ds = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});
    assert_eq!(instance["datasource"], ds);
    for p in panels(&dash) {
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"], ds, "panel {}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"], ds, "panel {}", p["title"]);
        }
    }

    // Every metric selector is filtered by instance.
    let queries = exprs(&dash);
    assert!(queries.len() >= 25, "{} queries", queries.len());
    for (title, expr) in &queries {
        assert!(expr.contains("[$__rate_interval]") || !expr.contains("rate("));
        for (name, end) in metric_names(expr) {
            assert!(
                expr[end..].starts_with(r#"{instance=~"$instance""#),
                "panel {title:?}: {name} not filtered by instance in {expr}"
            );
        }
    }

    // A daemon with every kind of activity: stream and datagram events, a rejected line,
    // flushes, rollups, and a rollup_into counter with a key missing from its table.
    let dir = temp_dir();
    let mut daemon = spawn_daemon(dir.path(), |_| {});
    create_repositories(&daemon.config);
    daemon.stop();
    let daemon = spawn_daemon(dir.path(), |c| {
        c.counters
            .push(common::counter_into_repositories("repo_downloads"))
    });
    assert_eq!(
        daemon.send("downloads a\nnope x\nrepo_downloads 1 3\nrepo_downloads 999\n"),
        "ok 3 1\n"
    );
    daemon.send_datagram(b"ips 10.0.0.1\n");
    let text = daemon.scrape_until("rollup and unmatched keys", |s| {
        s.get("tallyd_datagrams_received_total") == Some(1.0)
            && s.get("tallyd_flush_events_total") == Some(4.0)
            && s.get("tallyd_rollup_rows_total") >= Some(2.0)
            && s.get(r#"tallyd_rollup_unmatched_keys{counter="repo_downloads",database="0"}"#)
                == Some(1.0)
            && s.get(r#"tallyd_slot_rows{database="0"}"#).is_some()
    });
    check_scrape(&text);
    let exported = Samples::parse(&text).names().clone();

    let referenced = referenced_metrics(&dash);
    let alerts_path = format!("{ROOT}/dashboards/alerts.yml");
    let missing: Vec<&String> = referenced.difference(&exported).collect();
    assert!(
        missing.is_empty(),
        "dashboard/alerts use metrics the daemon does not export: {missing:?}\n{text}"
    );

    // Every dashboard expression parses: promtool checks a recording rule per expression.
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| {
            serde_json::json!({"record": format!("dashboard:check:{i}"),
                               "expr": substitute(expr, "1m")})
        })
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard-check", "rules": rules}]});
    let rules_path = dir.path().join("dashboard-rules.yml");
    // JSON is YAML.
    std::fs::write(&rules_path, serde_json::to_string_pretty(&file).unwrap()).unwrap();
    let (ok, out) = run_promtool(&["check", "rules", rules_path.to_str().unwrap()], "");
    assert!(ok, "dashboard queries do not parse:\n{out}");
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );

    let (ok, out) = run_promtool(&["check", "rules", &alerts_path], "");
    assert!(ok, "promtool check rules dashboards/alerts.yml:\n{out}");
}

/// Sets the flag when dropped, also when the test panics.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn prometheus_scrapes_and_dashboard_queries_return_data() {
    let Some(bin) = prometheus_binary() else {
        eprintln!(
            "skipped: the prometheus server binary is not available (set PROMETHEUS, or let \
             scripts/ensure-promtool --server download it)"
        );
        return;
    };
    let dir = temp_dir();
    let daemon = spawn_daemon(dir.path(), |_| {});
    let prometheus = Prometheus::start(&bin, dir.path(), daemon.metrics);

    // Steady traffic while Prometheus scrapes, so that every rate and quantile has samples. The
    // thread owns only the socket path, and stops when the test ends (or fails): the daemon is
    // dropped, and stopped, with the test.
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let sender = {
        let (socket, stop) = (daemon.socket.clone(), stop.0.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let lines = format!("downloads k{}\nips 10.0.0.{}\n", i % 7, i % 9);
                match send_lines(&socket, &lines) {
                    Ok(reply) => assert_eq!(reply, "ok 2 0\n"),
                    Err(_) if stop.load(Ordering::Relaxed) => return,
                    Err(e) => panic!("send: {e}"),
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    let dash = dashboard();
    let queries = exprs(&dash);
    let main = |title: &str, legend_idx: usize| {
        let of_panel: Vec<&String> = queries
            .iter()
            .filter(|(t, _)| t == title)
            .map(|(_, e)| e)
            .collect();
        assert!(!of_panel.is_empty(), "no panel {title:?}");
        // Scrapes every second: 5 s holds enough samples for rate().
        substitute(of_panel[legend_idx], "5s")
    };
    let checks = [
        (
            "events/s by counter",
            main("Events accepted /s by counter", 0),
        ),
        ("rows/s", main("Rows written /s", 0)),
        ("p99 freshness", main("Event to commit age", 1)),
        ("pending keys", main("Pending keys", 0)),
    ];
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut pending: Vec<&(&str, String)> = checks.iter().collect();
    let mut last = String::new();
    while !pending.is_empty() {
        pending.retain(|(what, promql)| {
            let Some(result) = prometheus.query(promql) else {
                last = format!("{what}: Prometheus not ready");
                return true;
            };
            let has_data = !result.is_empty()
                && result.iter().all(|r| {
                    r["value"][1]
                        .as_str()
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(f64::is_finite)
                });
            if !has_data {
                last = format!("{what}: {promql} -> {result:?}");
            }
            !has_data
        });
        if pending.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dashboard queries returned no data in time; last: {last}\n--- prometheus log:\n{}",
            prometheus.log()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The events/s query has a series for each counter that had traffic.
    let by_counter = prometheus.query(&checks[0].1).unwrap();
    let counters: BTreeSet<&str> = by_counter
        .iter()
        .filter_map(|r| r["metric"]["counter"].as_str())
        .collect();
    assert_eq!(counters, BTreeSet::from(["downloads", "ips"]));
    // The instance variable's query finds the daemon.
    let instances = prometheus
        .query("count by (instance) (tallyd_build_info)")
        .unwrap();
    assert_eq!(
        instances[0]["metric"]["instance"],
        daemon.metrics.to_string()
    );

    drop(stop);
    sender.join().expect("sender thread");
    drop(prometheus);
}
