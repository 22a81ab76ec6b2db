//! Logging: the tracing subscriber on stderr, its level filter and line format each behind a
//! reload handle, so that a config reload changes `log.level` and `log.format` without a restart.
//! Text lines are coloured only on a terminal ([`colour`]).

use std::io::IsTerminal;

use tracing_subscriber::layer::{Layered, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Layer, Registry};

use crate::config::{LogConfig, LogFormat};

type Filtered = Layered<reload::Layer<EnvFilter, Registry>, Registry>;
type Format = Box<dyn Layer<Filtered> + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log.level is not a valid filter: {0}")]
    Filter(#[from] tracing_subscriber::filter::ParseError),
    #[error("cannot install the logger: {0}")]
    Init(#[from] tracing_subscriber::util::TryInitError),
    #[error("cannot replace the logger's settings: {0}")]
    Reload(#[from] reload::Error),
}

/// The installed subscriber's handles: [`Logging::apply`] swaps filter and format.
#[derive(Clone)]
pub struct Logging {
    filter: reload::Handle<EnvFilter, Registry>,
    format: reload::Handle<Format, Filtered>,
}

/// RUST_LOG wins over `log.level` when set (at start and at every reload).
fn filter(config: &LogConfig) -> Result<EnvFilter, LogError> {
    Ok(EnvFilter::try_from_default_env().or_else(|_| EnvFilter::try_new(&config.level))?)
}

fn format(config: &LogConfig) -> Format {
    let layer = fmt::layer().with_writer(std::io::stderr).with_ansi(colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    ));
    match config.format {
        LogFormat::Json => layer.json().boxed(),
        LogFormat::Text => layer.boxed(),
    }
}

/// Colour (ANSI escape codes) only where a person reads the lines as they come: on a terminal,
/// unless `NO_COLOR` is set to anything but the empty string (https://no-color.org). A file,
/// a pipe or journald gets plain text, which `grep` and log shippers read as written.
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

impl Logging {
    /// Installs the process's subscriber as `config` says.
    pub fn init(config: &LogConfig) -> Result<Logging, LogError> {
        let (filter, filter_handle) = reload::Layer::new(filter(config)?);
        let (format, format_handle) = reload::Layer::new(format(config));
        tracing_subscriber::registry()
            .with(filter)
            .with(format)
            .try_init()?;
        Ok(Logging {
            filter: filter_handle,
            format: format_handle,
        })
    }

    /// Replaces the level filter and the line format; the lines logged after it use them.
    pub fn apply(&self, config: &LogConfig) -> Result<(), LogError> {
        self.filter.reload(filter(config)?)?;
        self.format.reload(format(config))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_on_a_terminal_and_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())));
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None));
    }
}
