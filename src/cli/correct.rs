//! `tallyd set` and `tallyd forget`: corrections sent to a running daemon as `!set` and
//! `!forget` control lines, in order with the events it has accepted, and answered once
//! committed (docs/protocol.md, "Corrections").

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::config::Config;

/// The `!set` line of `tallyd set COUNTER KEY VALUE [--window W]`: the window's time, when
/// given, in the counter's zone (as `tallyd get --window` reads it).
pub fn set_line(
    config: &Config,
    counter: &str,
    key: &str,
    value: &str,
    window: Option<&str>,
) -> Result<String> {
    let Some(window) = window else {
        return Ok(format!("!set {counter} {key} {value}"));
    };
    let declared = config
        .counters
        .iter()
        .find(|c| c.name == counter)
        .with_context(|| format!("unknown counter {counter:?}"))?;
    let Some(w) = declared.window()? else {
        bail!("--window: counter {counter} is not windowed");
    };
    let at = w.parse_instant(window).map_err(anyhow::Error::msg)?;
    Ok(format!("!set {counter} {key} {value} @{at}"))
}

/// Sends one correction `line` and waits for its answer: `ok` once committed, else the
/// daemon's reason.
pub async fn correct(config: &Config, line: &str) -> Result<()> {
    let Some(socket) = config.listen.socket() else {
        bail!("corrections need the stream socket, and listen.socket is off in this config");
    };
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connecting to {} (is tallyd running?)", socket.display()))?;
    let (rd, mut wr) = stream.into_split();
    wr.write_all(format!("{line}\n").as_bytes()).await?;
    let mut reply = String::new();
    if BufReader::new(rd).read_line(&mut reply).await? == 0 {
        bail!("tallyd closed the connection before answering");
    }
    match reply.trim_end().split_once(' ') {
        None if reply.trim_end() == "ok" => {
            println!("ok");
            Ok(())
        }
        Some(("error", why)) => {
            let reason = why.split(' ').next().unwrap_or_default();
            let counter = line.split(' ').nth(1).unwrap_or_default();
            match super::send::hint(config, reason, counter) {
                Some(hint) => bail!("refused: {why}: {hint}"),
                None => bail!("refused: {why}"),
            }
        }
        _ => bail!("unexpected reply from tallyd: {:?}", reply.trim_end()),
    }
}
