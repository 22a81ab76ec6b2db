//! `tallyd send`: events to a running daemon over its stream socket, waiting for their commit
//! (`!flush`) unless told not to, or as one batch counted exactly once (`--batch`); rejected
//! lines are printed with their reasons.

use std::io::{BufRead, Write};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use tallyd_client::nonblocking::Client;
use tallyd_client::{Options, Outcome};

use crate::config::Config;
use crate::protocol::KeyType;

/// Sends `event` (COUNTER KEY [DELTA] [@UNIX_MS], or `-`: lines from stdin). Exit code 2 when
/// a line was rejected.
pub async fn send(config: &Config, event: Vec<String>, no_wait: bool) -> Result<ExitCode> {
    let socket = stream_socket(config)?;
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to {} (is tallyd running?)", socket.display()))?;
    let (rd, mut wr) = stream.into_split();
    // Replies are read while lines are still being written: with `!errors`, every rejected
    // line is answered, and a daemon whose replies are not read stops reading the connection.
    let replies = (!no_wait).then(|| tokio::spawn(read_send_replies(rd, config.clone())));
    if !no_wait {
        wr.write_all(b"!errors\n").await?;
    }
    if event.len() == 1 && event[0] == "-" {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            let line = line.context("reading stdin")?;
            wr.write_all(line.as_bytes()).await?;
            wr.write_all(b"\n").await?;
        }
    } else {
        wr.write_all(format!("{}\n", event.join(" ")).as_bytes())
            .await?;
    }
    let Some(replies) = replies else {
        wr.shutdown().await?;
        return Ok(ExitCode::SUCCESS);
    };
    wr.write_all(b"!flush\n").await?;
    let (accepted, rejected) = replies.await??;
    println!("accepted {accepted}, rejected {rejected}");
    std::io::stdout().flush()?;
    Ok(if rejected == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

/// The stream socket `tallyd send` connects to.
fn stream_socket(config: &Config) -> Result<&std::path::Path> {
    match config.listen.socket() {
        Some(socket) => Ok(socket),
        None => {
            bail!("tallyd send needs the stream socket, and listen.socket is off in this config")
        }
    }
}

/// `tallyd send --batch ID`: `event` (or stdin's lines, for `-`) as one batch under `id`,
/// through the client library, which connects again with backoff and sends the batch again
/// under the same id when the connection drops before `!commit` is answered. Exit code 0
/// when the batch counts (committed now, or a duplicate of one committed before), rejected
/// lines or not: sending it again would change nothing.
pub async fn send_batch(config: &Config, id: &str, event: Vec<String>) -> Result<ExitCode> {
    let socket = stream_socket(config)?;
    // Its error names the socket and the last failure (is tallyd running?).
    let mut client = Client::connect(Options::new(socket)).await?;
    let mut batch = client.batch(id).await?;
    // The stdin line number of each line of the batch (empty lines are not sent), so that a
    // rejection names the line as the file numbers it.
    let mut numbers = Vec::new();
    if event.len() == 1 && event[0] == "-" {
        for (n, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.context("reading stdin")?;
            if !line.trim_matches([' ', '\t', '\r']).is_empty() {
                batch
                    .add_line(&line)
                    .await
                    .with_context(|| format!("line {} of stdin", n + 1))?;
                numbers.push(n + 1);
            }
        }
    } else {
        batch.add_line(&event.join(" ")).await?;
        numbers.push(1);
    }
    match batch.commit().await? {
        Outcome::Committed(tally) => {
            for r in &tally.rejections {
                let n = r
                    .line
                    .and_then(|n| n.checked_sub(1))
                    .and_then(|i| numbers.get(i as usize));
                let line = n.map_or_else(String::new, |n| format!(" {n}"));
                eprintln!("rejected{line}: {} \"{}\"", r.reason, r.excerpt);
            }
            println!(
                "committed {id}: accepted {}, rejected {}",
                tally.accepted, tally.rejected
            );
        }
        Outcome::Duplicate => {
            println!("duplicate {id}: committed before, nothing counted this time")
        }
    }
    std::io::stdout().flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Reads the replies to `tallyd send`'s `!errors` and `!flush`, printing each rejected line to
/// stderr (with what `config` says about it), and returns the `!flush` counts.
async fn read_send_replies(
    rd: tokio::net::unix::OwnedReadHalf,
    config: Config,
) -> Result<(u64, u64)> {
    let mut rd = BufReader::new(rd);
    let mut reply = String::new();
    loop {
        reply.clear();
        if rd.read_line(&mut reply).await? == 0 {
            bail!("tallyd closed the connection before answering");
        }
        let fields: Vec<&str> = reply.trim_end().splitn(4, ' ').collect();
        match fields[..] {
            ["ok"] => {}
            ["ok", accepted, rejected] => {
                let count = |s: &str| s.parse::<u64>().ok();
                if let (Some(a), Some(r)) = (count(accepted), count(rejected)) {
                    return Ok((a, r));
                }
                bail!("unexpected reply from tallyd: {:?}", reply.trim_end());
            }
            // The numbers count the connection's lines, `!errors` first: one more than stdin's.
            ["rejected", line, reason, text] => {
                let counter = text.trim_matches('"').split(' ').next().unwrap_or_default();
                let hint = hint(&config, reason, counter)
                    .map(|h| format!(": {h}"))
                    .unwrap_or_default();
                match line.parse::<u64>() {
                    Ok(n) => eprintln!("rejected {}: {reason} {text}{hint}", n.saturating_sub(1)),
                    Err(_) if text == "\"\"" => eprintln!("rejected: {reason}"),
                    Err(_) => eprintln!("rejected: {reason} {text}{hint}"),
                }
            }
            _ => bail!("unexpected reply from tallyd: {:?}", reply.trim_end()),
        }
    }
}

/// What `config` tells about a line of `counter` rejected for `reason`: the keys a `bad_key`
/// line's counter takes, the oldest window an `expired` event could still count in.
pub(super) fn hint(config: &Config, reason: &str, counter: &str) -> Option<String> {
    let c = config.counters.iter().find(|c| c.name == counter)?;
    match reason {
        "bad_key" => {
            let what = match c.key_type {
                KeyType::Text => "text keys (no spaces or control characters)",
                KeyType::Bigint => "bigint keys (a signed 64-bit integer such as 42)",
                KeyType::Uuid => "uuid keys (such as 0f8fad5b-d9cb-469f-a165-70867728950e)",
                KeyType::Inet => "inet keys (an IPv4 or IPv6 address such as 203.0.113.7)",
            };
            Some(format!(
                "counter {counter} takes {what}: key_type = \"{}\"",
                c.key_type.as_str()
            ))
        }
        "expired" => {
            let (window, keep) = (c.window().ok()??, c.keep_windows?);
            let now = crate::clock::now_ms();
            let oldest = window.back(window.bounds(now).0, keep.saturating_sub(1));
            Some(format!(
                "counter {counter} keeps its last {keep} {} windows (keep_windows = {keep}): the \
                 oldest it takes now is {} ({})",
                window.span().name(),
                window.name_of(oldest),
                window.zone_name()
            ))
        }
        _ => None,
    }
}
