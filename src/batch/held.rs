//! Held payloads on disk: a committed batch's lines, kept in `data_dir/batches/<payload>.batch`
//! from `!commit` until the batch is settled (routed as a journal record, or dropped as a
//! duplicate). A file is written whole under a temporary name, made durable, then renamed, so
//! a file under its final name is always complete.

use std::io::{self, Write as _};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// One held payload read back: its identity, the batch's id and its canonical lines.
pub(super) struct HeldFile {
    pub payload: u64,
    pub id: String,
    pub lines: Vec<u8>,
}

pub(super) fn path(dir: &Path, payload: u64) -> PathBuf {
    dir.join(format!("{payload}.batch"))
}

/// Writes payload `payload` (`id` on the first line, then the lines); with `fsync`, durable
/// before it returns (the file, then the directory entry).
pub(super) fn write(
    dir: &Path,
    payload: u64,
    id: &str,
    lines: &[u8],
    fsync: bool,
) -> io::Result<()> {
    let tmp = dir.join(format!("{payload}.tmp"));
    // Owner-only, like the journal's segments, whatever the umask.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(id.as_bytes())?;
    f.write_all(b"\n")?;
    f.write_all(lines)?;
    if fsync {
        f.sync_data()?;
    }
    drop(f);
    std::fs::rename(&tmp, path(dir, payload))?;
    if fsync {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Every held payload in `dir`, oldest first; temporary files (a write a crash cut short,
/// never acknowledged) are deleted.
pub(super) fn read_all(dir: &Path) -> io::Result<Vec<HeldFile>> {
    let mut held = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".tmp") {
            std::fs::remove_file(&path)?;
            continue;
        }
        let Some(payload) = name.strip_suffix(".batch").and_then(|p| p.parse().ok()) else {
            continue;
        };
        let bytes = std::fs::read(&path)?;
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(bytes.len());
        let id = String::from_utf8_lossy(&bytes[..split]).into_owned();
        let lines = bytes.get(split + 1..).unwrap_or_default().to_vec();
        held.push(HeldFile { payload, id, lines });
    }
    held.sort_by_key(|h| h.payload);
    Ok(held)
}

pub(super) fn remove(dir: &Path, payload: u64) -> io::Result<()> {
    match std::fs::remove_file(path(dir, payload)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_payloads_read_back_and_cut_ones_go() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 7, "app:a", b"c k 1 @5\n", true).unwrap();
        write(dir.path(), 3, "app:b", b"", false).unwrap();
        std::fs::write(dir.path().join("9.tmp"), b"app:c\nc k").unwrap();
        let held = read_all(dir.path()).unwrap();
        let got: Vec<_> = held
            .iter()
            .map(|h| (h.payload, h.id.as_str(), &h.lines[..]))
            .collect();
        assert_eq!(
            got,
            vec![(3, "app:b", &b""[..]), (7, "app:a", &b"c k 1 @5\n"[..])]
        );
        assert!(!dir.path().join("9.tmp").exists());
        remove(dir.path(), 7).unwrap();
        remove(dir.path(), 7).unwrap();
        assert_eq!(read_all(dir.path()).unwrap().len(), 1);
    }
}
