//! Where PostgreSQL's server binaries are: `[database] bin_dir`, else `pg_config --bindir`,
//! else the newest /usr/lib/postgresql/*/bin.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{EmbeddedError, EmbeddedOptions, SEARCH_ROOT};

fn has_server_binaries(dir: &Path) -> bool {
    dir.join("postgres").is_file() && dir.join("initdb").is_file()
}

/// Find server binaries: `pg_config --bindir` if it contains `postgres` and `initdb`, else the
/// highest version under /usr/lib/postgresql/*/bin. ([`EmbeddedOptions::bin_dir`] overrides
/// this search in [`Embedded::start`].)
pub fn find_bin_dir() -> Result<PathBuf, EmbeddedError> {
    let mut searched = Vec::new();

    // pg_config may be missing or belong to a client-only install; both just mean "keep looking".
    if let Ok(out) = Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
    {
        if out.status.success() {
            let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !s.is_empty() {
                let p = PathBuf::from(s);
                if has_server_binaries(&p) {
                    return Ok(p);
                }
                searched.push(p);
            }
        }
    }

    let mut versions: Vec<(Vec<u32>, PathBuf)> = Vec::new();
    if let Ok(entries) = fs::read_dir(SEARCH_ROOT) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // Non-numeric directories sort first so real versions win.
            let key: Vec<u32> = name.split('.').map(|c| c.parse().unwrap_or(0)).collect();
            versions.push((key, entry.path().join("bin")));
        }
    }
    versions.sort();
    for (_, bin) in versions.iter().rev() {
        if has_server_binaries(bin) {
            return Ok(bin.clone());
        }
    }
    if versions.is_empty() {
        searched.push(PathBuf::from(format!("{SEARCH_ROOT}/*/bin")));
    } else {
        searched.extend(versions.into_iter().map(|(_, p)| p));
    }
    Err(EmbeddedError::NoBinaries { searched })
}

pub(super) fn resolve_bin_dir(opts: &EmbeddedOptions) -> Result<PathBuf, EmbeddedError> {
    match &opts.bin_dir {
        Some(p) if has_server_binaries(p) => Ok(p.clone()),
        Some(p) => Err(EmbeddedError::NoBinaries {
            searched: vec![p.clone()],
        }),
        None => find_bin_dir(),
    }
}
