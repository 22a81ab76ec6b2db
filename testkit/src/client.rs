//! [`LineClient`]: a stream connection to tallyd speaking the line protocol.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// How long a `!sync` may wait for its answer: a liveness bound, not a speed check.
const PATIENCE: Duration = Duration::from_secs(120);

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

    /// Sends `!sync` and expects `ok`: every earlier line of this connection is durable in the
    /// journal (not necessarily committed). Panics after [`PATIENCE`] without an answer.
    pub async fn sync(&mut self) {
        self.send(b"!sync\n").await;
        let reply = tokio::time::timeout(PATIENCE, self.read_line())
            .await
            .unwrap_or_else(|_| panic!("`!sync` not answered within {PATIENCE:?}"));
        assert_eq!(reply, "ok\n", "`!sync` answer");
    }

    /// Sends `lines`, then `!sync` (see [`LineClient::sync`]).
    pub async fn send_synced(&mut self, lines: &[u8]) {
        self.send(lines).await;
        self.sync().await;
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

/// Connects to `socket`, sends `lines` and `!sync` (see [`LineClient::sync`]): their events
/// are durable in the journal. Returns the connection, whose `!flush` waits for them.
pub async fn send_synced(socket: &Path, lines: impl IntoIterator<Item = String>) -> LineClient {
    let mut c = LineClient::connect(socket).await;
    c.send_synced(&buf_of(lines)).await;
    c
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
