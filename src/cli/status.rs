//! `tallyd status`: the running daemon's status view, as a table or raw JSON.

use anyhow::{bail, Context, Result};

use crate::config::Config;

/// `tallyd status`: GETs /status from the running daemon's metrics.listen.
pub async fn show_status(config: &Config, json: bool) -> Result<()> {
    let Some(listen) = config.metrics.listen() else {
        bail!("metrics.listen is empty: the status endpoint is off (set it to use tallyd status)");
    };
    let (code, body) = crate::http::get(listen, "/status").await?;
    if code != 200 {
        bail!(
            "GET http://{listen}/status answered {code}: {}",
            body.trim_end()
        );
    }
    if json {
        print!("{body}");
        return Ok(());
    }
    let status: crate::status::Status = serde_json::from_str(&body)
        .with_context(|| format!("reading the answer of http://{listen}/status"))?;
    print!("{}", status.table());
    Ok(())
}
