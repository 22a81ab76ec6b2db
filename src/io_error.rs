//! The one I/O error type: what was being done, to which path, and the OS error.
//!
//! Every module's error wraps this instead of keeping its own `Io { what, path, cause }`
//! variant, so all file and socket failures read the same way: `{what} {path}: {cause}`.

use std::io;
use std::path::{Path, PathBuf};

/// An I/O failure on a path. The message prints the cause, so it is not also the `source()`.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {cause}", path.display())]
pub struct IoError {
    /// What was being done, as a verb phrase: "cannot bind", "cannot read config file".
    pub what: &'static str,
    pub path: PathBuf,
    pub cause: io::Error,
}

impl IoError {
    /// A `map_err` adapter: `.map_err(IoError::on("cannot open", &path))?`.
    pub fn on<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> IoError + 'a {
        move |cause| IoError {
            what,
            path: path.to_path_buf(),
            cause,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn prints_the_cause_once_and_has_no_source() {
        let err =
            IoError::on("cannot open", Path::new("/x/y"))(io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(err.to_string(), "cannot open /x/y: entity not found");
        assert!(err.source().is_none());
    }
}
