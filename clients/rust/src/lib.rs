//! A client for tallyd's line protocol over its Unix stream socket:
//! events of every kind, `flush`, `sync`, `ping`, corrections, and exactly-once batches,
//! blocking ([`Client`]) or on tokio ([`nonblocking::Client`], feature `tokio`).
//!
//! # Count downloads from a log file exactly once
//!
//! Each chunk of 10,000 lines is a batch named by the file and the chunk's first line: a
//! re-run, or a retry after tallyd or the connection went down, sends the same batches under
//! the same ids, and tallyd counts each once.
//!
//! ```no_run
//! use std::io::BufRead;
//! use tallyd_client::{Client, Event, Options};
//!
//! fn import(path: &str) -> Result<(), Box<dyn std::error::Error>> {
//!     let mut tallyd = Client::connect(Options::new("/run/tallyd/tallyd.sock"))?;
//!     let lines: Vec<String> = std::io::BufReader::new(std::fs::File::open(path)?).lines().collect::<Result<_, _>>()?;
//!     for (n, chunk) in lines.chunks(10_000).enumerate() {
//!         let mut batch = tallyd.batch(&format!("importer:{path}:{}", n * 10_000))?;
//!         for line in chunk {
//!             batch.add(&Event::new("downloads", line.split(' ').nth(6).unwrap_or("-")))?;
//!         }
//!         println!("{:?}", batch.commit()?); // Committed(Tally { accepted, rejected, .. }) or Duplicate
//!     }
//!     Ok(())
//! }
//! ```
//!
//! # What it guarantees
//!
//! - **Batches count exactly once.** [`Client::batch`] sends `!batch <id>`, [`Batch::add`]
//!   sends each line and keeps it, [`Batch::commit`] sends `!commit`. When the connection is
//!   lost before the answer, the client connects again (with [`Options::connect`]'s backoff)
//!   and sends the whole batch again under the same id; tallyd answers `ok` (this copy counted)
//!   or `duplicate` (a copy counted before), both [`Outcome`]s meaning "counted once". The
//!   client keeps at most one batch, of at most [`Options::max_batch_bytes`].
//! - **Events outside batches** are buffered (up to [`Options::write_buffer_bytes`]) and
//!   acknowledged by [`Client::flush`] (committed), [`Client::sync`] (durable in the journal)
//!   or a correction. A connection lost before that fails the operation with
//!   [`Error::ConnectionLost`], saying how many lines are in doubt; the next operation
//!   connects again. Nothing is resent by itself: resending could count twice.
//! - **Back-pressure.** When tallyd stops reading (its journal is full, the database has been
//!   down long), writes wait, and the client keeps reading replies meanwhile; memory stays at
//!   the write buffer plus the open batch.
//! - **Rejections with their reasons.** Every connection starts with `!errors`; the
//!   `rejected <line> <reason> "<excerpt>"` replies come back in [`Tally::rejections`], a
//!   refused correction or batch as [`Error::Refused`] with tallyd's reason.
//!
//! # Pipelining
//!
//! [`Client::send_lines`] queues a pre-built buffer of whole lines; [`Client::request`] sends
//! `!ping`, `!flush` or `!sync` without waiting and returns a [`Ticket`];
//! [`Client::answer`] waits for that answer later, reading (and writing) everything before
//! it. A load generator writes many lines and requests, then collects the answers.
//!
//! # Layout
//!
//! `line` (the lines written), `reply` (the lines read), `session` (one connection's
//! bookkeeping), `core` (the decisions both drivers share), `blocking` and `nonblocking` (the
//! drivers: poll(2) on a std socket, tokio), `sys` (the system calls), `options`, `error`.

mod blocking;
mod core;
mod error;
mod line;
#[cfg(feature = "tokio")]
pub mod nonblocking;
mod options;
mod reply;
mod session;
mod sys;

pub use blocking::{Batch, Client};
pub use core::{Outcome, Request, Tally};
pub use error::{Error, Lost};
pub use line::{Event, Value, MAX_BATCH_ID_BYTES};
pub use options::{Backoff, Options};
pub use reply::{Rejection, Reply};
pub use session::{Answer, Ticket};
