//! [`LineClient`]: a stream connection to tallyd speaking the line protocol.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// A stream connection speaking the line protocol.
pub struct LineClient {
    rd: BufReader<OwnedReadHalf>,
    pub wr: OwnedWriteHalf,
}

impl LineClient {
    pub async fn connect(path: &Path) -> LineClient {
        let stream = UnixStream::connect(path).await.expect("connect to tallyd");
        let (rd, wr) = stream.into_split();
        LineClient {
            rd: BufReader::new(rd),
            wr,
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.expect("write to tallyd");
    }

    pub async fn read_line(&mut self) -> String {
        let mut line = String::new();
        self.rd
            .read_line(&mut line)
            .await
            .expect("read from tallyd");
        line
    }

    /// Sends `!flush` and returns (accepted, rejected) since the previous one.
    pub async fn flush(&mut self) -> (u64, u64) {
        self.send(b"!flush\n").await;
        let line = self.read_line().await;
        let f: Vec<&str> = line.trim_end().split(' ').collect();
        assert_eq!(f.len(), 3, "unexpected reply {line:?}");
        assert_eq!(f[0], "ok", "unexpected reply {line:?}");
        (f[1].parse().unwrap(), f[2].parse().unwrap())
    }
}

/// The lines, each followed by `\n`.
pub fn buf_of(lines: impl IntoIterator<Item = String>) -> Vec<u8> {
    let mut out = Vec::new();
    for l in lines {
        out.extend_from_slice(l.as_bytes());
        out.push(b'\n');
    }
    out
}
