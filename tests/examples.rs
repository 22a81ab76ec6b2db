//! The documentation's examples, run as written: every fenced block of README.md,
//! docs/counters.md, docs/corrections.md and docs/operations.md, extracted from the pages
//! themselves (so a page cannot drift from what runs), in order, against the real `tallyd run`
//! with the repository's config.toml (README's quick start) and then examples/config.toml.
//!
//! By language: `sh` blocks run in bash (`set -e -o pipefail`, the exports of earlier blocks
//! kept) in a directory laid out as a checkout (config.toml, examples/config.toml, the binary
//! as target/release/tallyd); `sql` blocks run in the daemon's database; `tallyd` blocks are
//! protocol lines sent on its stream socket, every event accepted and every control line
//! answered; `toml` blocks must already be in the running config (the page documents it), or,
//! marked, are added to it (the page then reloads) or merged into a copy that `tallyd
//! check-config` must accept; `python` and `js` blocks (statsd clients) run with python3 and
//! node; a `text` block marked as output must match what the block before it printed (`...`
//! matches anything). A block the test does not run carries an explicit marker, an HTML comment
//! on the line before it, with the reason:
//!
//! - `<!-- example: not run (why) -->`
//! - `<!-- example: check only (why) -->` (toml)
//! - `<!-- example: add to the config -->` (toml)
//! - `<!-- example: starts tallyd with FILE -->` (the block that starts the daemon: the test
//!   starts `tallyd run` with FILE itself instead of building it)
//! - `<!-- example: exits N -->` (sh: the block must exit with N)
//! - `<!-- example: output -->` (text: what the block before it prints)

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{free_port, temp_dir, Daemon, BIN};
use tallyd::config::Config;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The pages whose examples run, in this order.
const PAGES: [&str; 4] = [
    "README.md",
    "docs/counters.md",
    "docs/corrections.md",
    "docs/operations.md",
];
const MARKER: &str = "<!-- example:";

/// One fenced block of a page.
#[derive(Debug)]
struct Block {
    page: &'static str,
    /// 1-based line of the opening fence.
    line: usize,
    lang: String,
    text: String,
    /// What the marker before it says, after `example:`.
    marker: Option<String>,
}

impl Block {
    fn at(&self) -> String {
        format!("{}:{} ({})", self.page, self.line, self.lang)
    }
}

/// The fenced blocks of `text` (indented ones too, as in a list), with their markers.
fn blocks(page: &'static str, text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        let Some(lang) = trimmed.strip_prefix("```") else {
            i += 1;
            continue;
        };
        let indent = lines[i].len() - trimmed.len();
        let marker = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(|l| l.trim())
            .and_then(|l| l.strip_prefix(MARKER))
            .map(|m| m.trim_end_matches("-->").trim().to_string());
        let start = i;
        let mut body = Vec::new();
        i += 1;
        while i < lines.len() && lines[i].trim_start() != "```" {
            body.push(lines[i].get(indent..).unwrap_or(lines[i].trim_start()));
            i += 1;
        }
        assert!(i < lines.len(), "{page}:{}: unclosed block", start + 1);
        out.push(Block {
            page,
            line: start + 1,
            lang: lang.trim().to_string(),
            text: body.iter().map(|l| format!("{l}\n")).collect(),
            marker,
        });
        i += 1;
    }
    out
}

/// Whether `tool` can run here; else, under CI=true, a failure, and elsewhere a skip with why.
fn have(tool: &str, check: &mut Command) -> bool {
    let ok = check
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        let why = format!("{tool} is missing: scripts/ensure-clients installs it");
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        eprintln!("skipping the examples that need it: {why}");
    }
    ok
}

/// The checkout-like directory the examples run in, and the daemon they run against.
struct Session {
    dir: PathBuf,
    env: Vec<(String, String)>,
    daemon: Option<Daemon>,
    /// The config the running daemon was started with (and reloads).
    config: Option<PathBuf>,
    /// The output (stdout and stderr) of the last block that ran.
    last_output: String,
    socat: bool,
    python: bool,
    node: bool,
    logs: Vec<PathBuf>,
}

impl Session {
    fn new(dir: &Path) -> Session {
        std::fs::copy(format!("{ROOT}/config.toml"), dir.join("config.toml")).unwrap();
        std::fs::create_dir_all(dir.join("examples")).unwrap();
        std::fs::copy(
            format!("{ROOT}/examples/config.toml"),
            dir.join("examples/config.toml"),
        )
        .unwrap();
        std::fs::create_dir_all(dir.join("target/release")).unwrap();
        std::os::unix::fs::symlink(BIN, dir.join("target/release/tallyd")).unwrap();
        std::fs::write(dir.join(".env"), "").unwrap();
        let clients = format!("{ROOT}/tests/clients/node_modules");
        Session {
            dir: dir.to_path_buf(),
            // The configs' metrics port, 9187, may be taken on this machine.
            env: vec![
                (
                    "TALLYD_METRICS_LISTEN".into(),
                    format!("127.0.0.1:{}", free_port()),
                ),
                ("NODE_PATH".into(), clients.clone()),
            ],
            daemon: None,
            config: None,
            last_output: String::new(),
            socat: have("socat", Command::new("socat").arg("-V")),
            python: have(
                "python3 with datadog",
                Command::new("python3").args(["-c", "import datadog"]),
            ),
            node: have(
                "node with hot-shots and unix-dgram",
                Command::new("node")
                    .args(["-e", "require('hot-shots'); require('unix-dgram')"])
                    .env("NODE_PATH", &clients),
            ),
            logs: Vec::new(),
        }
    }

    fn stop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            assert!(daemon.terminate().success(), "tallyd did not stop cleanly");
        }
    }

    /// Starts `tallyd run` with `file` (relative to the directory), after stopping the one
    /// running.
    fn start(&mut self, file: &str) {
        self.stop();
        let config = self.dir.join(file);
        let (env, cwd) = (self.env.clone(), self.dir.clone());
        // From the checkout's root, as scripts/run and examples/run start it.
        let daemon = Daemon::spawn_with(Path::new(BIN), &config, |cmd| {
            cmd.current_dir(cwd).envs(env);
        });
        self.logs.push(daemon.log_path().to_path_buf());
        self.daemon = Some(daemon);
        self.config = Some(config);
    }

    /// The running daemon's config, as it reads it.
    fn config(&self, at: &str) -> Config {
        let path = self
            .config
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: no tallyd runs yet"));
        Config::load(path).unwrap()
    }

    fn run_sh(&mut self, b: &Block) {
        if b.text.contains("socat") && !self.socat {
            return;
        }
        let n = b.line;
        let script = self
            .dir
            .join(format!(".block-{}-{n}.sh", b.page.replace('/', "-")));
        std::fs::write(&script, &b.text).unwrap();
        let env = self.dir.join(".env");
        let runner = format!(
            "exec 2>&1\ncd {dir:?}\n. {env:?}\nset -e -o pipefail\n. {script:?}\nexport -p > {env:?}\n",
            dir = self.dir,
        );
        let out = Command::new("timeout")
            .args(["300", "bash", "-c", &runner])
            .envs(self.env.iter().cloned())
            .output()
            .unwrap();
        self.last_output = String::from_utf8_lossy(&out.stdout).into_owned();
        let expected: i32 = b
            .marker
            .as_deref()
            .and_then(|m| m.strip_prefix("exits "))
            .map_or(0, |n| n.parse().expect("exits N"));
        assert!(
            out.status.code() == Some(expected),
            "{}: exited {} (expected {expected}):\n{}\n--- output:\n{}",
            b.at(),
            out.status,
            b.text,
            self.last_output
        );
    }

    /// The events counted so far for the counters that take statsd lines.
    fn statsd_events(&self, at: &str) -> i64 {
        let config = self.config(at);
        let names: Vec<String> = config
            .counters
            .iter()
            .filter(|c| c.statsd.is_some())
            .map(|c| format!("'{}'", c.name))
            .collect();
        assert!(!names.is_empty(), "{at}: no counter takes statsd lines");
        let sql = format!(
            "SELECT coalesce(sum(count), 0)::text FROM tallyd.totals WHERE counter IN ({})",
            names.join(", ")
        );
        let rows = common::run_sql(self.config.as_ref().unwrap(), &sql);
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0)?.parse().ok(),
                _ => None,
            })
            .unwrap()
    }

    /// A statsd client example: it runs, and its events reach the counters (a client drops
    /// what it cannot send without a word, so its exit status alone proves nothing).
    fn run_client(&mut self, b: &Block, program: &str, ext: &str) {
        let before = self.statsd_events(&b.at());
        self.run_program(b, program, ext);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.statsd_events(&b.at()) <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "{}: no event of it was counted:\n{}",
                b.at(),
                b.text
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn run_program(&mut self, b: &Block, program: &str, ext: &str) {
        let file = self.dir.join(format!(".block-{}.{ext}", b.line));
        std::fs::write(&file, &b.text).unwrap();
        let out = Command::new("timeout")
            .args(["60", program])
            .arg(&file)
            .current_dir(&self.dir)
            .envs(self.env.iter().cloned())
            .output()
            .unwrap();
        self.last_output = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{}: {program} exited {}:\n{}\n--- output:\n{}",
            b.at(),
            out.status,
            b.text,
            self.last_output
        );
    }

    fn run_sql(&mut self, b: &Block) {
        let config = self.config(&b.at());
        let rt = tokio::runtime::Runtime::new().unwrap();
        let result = rt.block_on(async {
            let db = tallyd::store::Databases::connect_only(&config)
                .unwrap()
                .remove(0);
            let client = db.connect().await.map_err(|e| e.to_string())?;
            client.simple_query(&b.text).await.map_err(|e| {
                let e = tallyd::store::DbError::from(e);
                e.to_string()
            })
        });
        match result {
            Ok(messages) => {
                self.last_output = messages
                    .iter()
                    .filter_map(|m| match m {
                        tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                            (0..r.len())
                                .map(|i| r.get(i).unwrap_or("NULL"))
                                .collect::<Vec<_>>()
                                .join(" | ")
                                + "\n",
                        ),
                        _ => None,
                    })
                    .collect();
            }
            Err(e) => panic!("{}: {e}\n{}", b.at(), b.text),
        }
    }

    /// Protocol lines on a new stream connection: every event line accepted, every control
    /// line answered `ok` (`pong` for `!ping`).
    fn send_lines(&mut self, b: &Block) {
        let config = self.config(&b.at());
        let socket = config.listen.socket().unwrap();
        let mut conn = UnixStream::connect(socket).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let lines: Vec<&str> = b.text.lines().filter(|l| !l.trim().is_empty()).collect();
        let events = lines.iter().filter(|l| !l.starts_with('!')).count();
        conn.write_all(format!("!errors\n{}!flush\n", b.text).as_bytes())
            .unwrap();
        let mut rd = BufReader::new(conn);
        let mut expect = vec!["ok".to_string()];
        expect.extend(
            lines
                .iter()
                .filter(|l| l.starts_with('!'))
                .map(|l| if l.trim() == "!ping" { "pong" } else { "ok" }.to_string()),
        );
        expect.push(format!("ok {events} 0"));
        let mut got = Vec::new();
        for _ in 0..expect.len() {
            let mut line = String::new();
            rd.read_line(&mut line).unwrap();
            got.push(line.trim_end().to_string());
        }
        assert_eq!(got, expect, "{}: the answers to\n{}", b.at(), b.text);
        self.last_output = got.join("\n") + "\n";
    }

    fn toml(&mut self, b: &Block) {
        let block: toml::Table = b
            .text
            .parse()
            .unwrap_or_else(|e| panic!("{}: not TOML: {e}", b.at()));
        let path = self
            .config
            .clone()
            .unwrap_or_else(|| panic!("{}: no tallyd runs yet", b.at()));
        let mut live: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
        match b.marker.as_deref() {
            Some("add to the config") => {
                merge(&mut live, &block);
                std::fs::write(&path, toml::to_string(&live).unwrap()).unwrap();
                Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", b.at()));
            }
            Some(m) if m.starts_with("check only") => {
                merge(&mut live, &block);
                let copy = path.with_file_name(".check.toml");
                std::fs::write(&copy, toml::to_string(&live).unwrap()).unwrap();
                let out = common::tallyd(&copy, &["check-config"]);
                assert!(
                    out.status.success(),
                    "{}: tallyd check-config refuses it: {}",
                    b.at(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => {
                let missing = not_in(&live, &block);
                assert!(
                    missing.is_empty(),
                    "{}: the page shows what the running config ({}) does not hold: {missing:?} \
                     (declare it in examples/config.toml, or mark the block `add to the config`)",
                    b.at(),
                    path.display()
                );
            }
            Some(m) => panic!("{}: unknown marker {m:?} for a toml block", b.at()),
        }
    }

    fn output(&mut self, b: &Block) {
        let want: Vec<&str> = b.text.lines().collect();
        let got: Vec<&str> = self.last_output.lines().collect();
        let matches =
            want.len() == got.len() && want.iter().zip(&got).all(|(w, g)| matches_line(w, g));
        assert!(
            matches,
            "{}: the page says the block before prints\n{}--- it printed:\n{}",
            b.at(),
            b.text,
            self.last_output
        );
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            let _ = daemon.terminate();
        }
    }
}

/// `want`, where each `...` matches any text, against `got`.
fn matches_line(want: &str, got: &str) -> bool {
    let mut parts = want.split("...");
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = got.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

/// Adds `block` to `live`: a `[[counters]]` entry replaces the one of the same name (or is
/// appended), other tables' keys are set.
fn merge(live: &mut toml::Table, block: &toml::Table) {
    for (key, value) in block {
        match (key.as_str(), value) {
            ("counters", toml::Value::Array(added)) => {
                let counters = live
                    .entry("counters")
                    .or_insert_with(|| toml::Value::Array(Vec::new()))
                    .as_array_mut()
                    .unwrap();
                for c in added {
                    counters.retain(|o| o.get("name") != c.get("name"));
                    counters.push(c.clone());
                }
            }
            (_, toml::Value::Table(t)) => {
                let section = live
                    .entry(key.clone())
                    .or_insert_with(|| toml::Value::Table(Default::default()));
                match section.as_table_mut() {
                    Some(s) => merge(s, t),
                    None => *section = value.clone(),
                }
            }
            _ => {
                live.insert(key.clone(), value.clone());
            }
        }
    }
}

/// What of `block` `live` does not hold as the block says: each counter must be declared
/// exactly so, each other key set to that value.
fn not_in(live: &toml::Table, block: &toml::Table) -> Vec<String> {
    let mut missing = Vec::new();
    for (key, value) in block {
        match (key.as_str(), value) {
            ("counters", toml::Value::Array(shown)) => {
                let declared = live.get("counters").and_then(|c| c.as_array());
                for c in shown {
                    let found = declared
                        .into_iter()
                        .flatten()
                        .find(|o| o.get("name") == c.get("name"));
                    if found != Some(c) {
                        missing.push(format!("counter {}", c.get("name").unwrap()));
                    }
                }
            }
            (_, toml::Value::Table(t)) => match live.get(key).and_then(|v| v.as_table()) {
                Some(l) => missing.extend(not_in(l, t).into_iter().map(|m| format!("{key}.{m}"))),
                None => missing.push(key.clone()),
            },
            _ => {
                if live.get(key) != Some(value) {
                    missing.push(key.clone());
                }
            }
        }
    }
    missing
}

#[test]
fn the_documentation_examples_run_as_written() {
    let dir = temp_dir();
    let mut s = Session::new(dir.path());
    let mut ran: std::collections::BTreeMap<String, usize> = Default::default();
    let mut not_run = Vec::new();
    for page in PAGES {
        let text = std::fs::read_to_string(format!("{ROOT}/{page}")).unwrap();
        for b in blocks(page, &text) {
            let marker = b.marker.as_deref().unwrap_or_default();
            if let Some(why) = marker.strip_prefix("not run") {
                let why = why.trim().trim_matches(|c| c == '(' || c == ')');
                assert!(!why.is_empty(), "{}: `not run` needs its reason", b.at());
                not_run.push(format!("{}: {why}", b.at()));
                continue;
            }
            if let Some(file) = marker.strip_prefix("starts tallyd with ") {
                s.start(file.trim());
                *ran.entry("daemon start".into()).or_default() += 1;
                continue;
            }
            let kind = match (b.lang.as_str(), marker) {
                ("text", "output") => {
                    s.output(&b);
                    "output check"
                }
                ("text" | "", "") => continue,
                ("sh", m) if m.is_empty() || m.starts_with("exits ") => {
                    s.run_sh(&b);
                    "sh"
                }
                ("sql", "") => {
                    s.run_sql(&b);
                    "sql"
                }
                ("tallyd", "") => {
                    s.send_lines(&b);
                    "protocol"
                }
                ("toml", _) => {
                    s.toml(&b);
                    "toml"
                }
                ("python", "") if s.python => {
                    s.run_client(&b, "python3", "py");
                    "python"
                }
                ("js", "") if s.node => {
                    s.run_client(&b, "node", "js");
                    "js"
                }
                ("python" | "js", "") => continue,
                _ => panic!(
                    "{}: no way to run a {:?} block marked {marker:?}: mark it \
                     `<!-- example: not run (why) -->` if it is not to run",
                    b.at(),
                    b.lang
                ),
            };
            *ran.entry(kind.into()).or_default() += 1;
        }
    }
    // A second start on the same cluster: what already exists there (the schema, the
    // extension) must not fill the log with the driver's notices.
    let last = s.config.clone().unwrap();
    let last = last
        .strip_prefix(&s.dir)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    s.start(&last);
    s.stop();
    for log in &s.logs {
        let text = std::fs::read_to_string(log).unwrap();
        assert!(
            !text.contains("already exists, skipping"),
            "migration notices in the log:\n{text}"
        );
    }
    println!("ran: {ran:?}");
    println!("not run ({}):", not_run.len());
    for n in &not_run {
        println!("  {n}");
    }
    for kind in [
        "sh",
        "sql",
        "protocol",
        "toml",
        "output check",
        "daemon start",
    ] {
        assert!(
            ran.get(kind).is_some_and(|&n| n > 0),
            "no {kind} block ran: {ran:?}"
        );
    }
}

#[test]
fn output_patterns_match_as_the_pages_mean() {
    assert!(matches_line("a ... c", "a b c"));
    assert!(matches_line(
        "count=6 first=... last=...",
        "count=6 first=1 last=2"
    ));
    assert!(!matches_line("count=6 ...", "count=7 x"));
    assert!(!matches_line("a", "ab"));
    assert!(matches_line("x...", "xyz"));
}
