//! The `tallyd` commands, one file by job: [`run`] (the daemon in this process, its signals
//! and its private PostgreSQL), [`send`] (events to a running daemon), [`get`] (one key's exact
//! total), [`correct`] (`set` and `forget`), [`status`] (a running daemon's status view), [`admin`] (check-config, reload,
//! migrate, rollup, move-shards). The binary (src/main.rs) only parses arguments and calls
//! these; each prints what the user asked for and returns errors for the binary to print.

pub mod admin;
pub mod correct;
pub mod get;
pub mod run;
pub mod send;
pub mod status;
