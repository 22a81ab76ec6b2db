//! Framing: a byte stream ([`LineBuffer`]) or one datagram ([`datagram_lines`]) into lines,
//! refusing lines longer than `max_line_bytes` the same way the parser counts them.

use memchr::memchr_iter;

use super::reject::Reject;

/// Framing for a byte stream: owns the read buffer so that the caller reads straight into it
/// (e.g. with tokio's `AsyncReadExt::read_buf(&mut Vec<u8>)`), then takes the complete lines.
///
/// Usage: append at most `read_size` bytes to [`read_buf`](Self::read_buf), call
/// [`drain_lines`](Self::drain_lines), repeat; at end of stream call [`finish`](Self::finish).
pub struct LineBuffer {
    pub(super) buf: Vec<u8>,
    max_line_bytes: usize,
    read_size: usize,
    /// Length of the front of `buf` already searched for `\n` (the partial tail kept by the
    /// last drain), so a line arriving in many small reads is not rescanned each time.
    scanned: usize,
    /// Inside an over-long line that was already reported: drop bytes up to the next `\n`.
    discarding: bool,
}

impl LineBuffer {
    /// `read_size` is the most the caller appends per read; 0 is treated as 1 so a read can
    /// never be mistaken for end of stream for lack of room.
    pub fn new(max_line_bytes: usize, read_size: usize) -> LineBuffer {
        LineBuffer {
            buf: Vec::new(),
            max_line_bytes,
            read_size: read_size.max(1),
            scanned: 0,
            discarding: false,
        }
    }

    /// The buffer to append newly read bytes to, with at least `read_size` bytes of spare
    /// capacity. Capacity stays at `max_line_bytes + read_size` as long as the caller appends
    /// at most `read_size` bytes between drains.
    pub fn read_buf(&mut self) -> &mut Vec<u8> {
        let len = self.buf.len();
        if self.buf.capacity() - len < self.read_size {
            // Go straight to the bound so a busy stream settles on one allocation instead of
            // creeping up through reallocations as partial tails vary.
            let target = len.max(self.max_line_bytes) + self.read_size;
            self.buf.reserve_exact(target - len);
        }
        &mut self.buf
    }

    /// Calls `f` for every complete line now in the buffer (without the `\n`), or
    /// `Err(Reject::TooLong)` once per over-long line, then keeps only the partial tail.
    ///
    /// A partial tail longer than `max_line_bytes` is reported right away and then discarded
    /// up to its `\n`, so an endless line costs bounded memory.
    pub fn drain_lines(&mut self, mut f: impl FnMut(Result<&[u8], Reject>)) {
        self.drain_lines_while(|line| {
            f(line);
            true
        });
    }

    /// Like [`drain_lines`](Self::drain_lines), but stops at the first complete line for which
    /// `f` returns false: that line and everything after it stay in the buffer, unconsumed, for
    /// the next drain. Returns whether it stopped so (then the buffer holds a complete line).
    pub fn drain_lines_while(&mut self, mut f: impl FnMut(Result<&[u8], Reject>) -> bool) -> bool {
        let max = self.max_line_bytes;
        let buf = &self.buf[..];
        let scanned = self.scanned.min(buf.len());
        let mut start = 0;
        let mut stopped = false;
        for end in memchr_iter(b'\n', &buf[scanned..]).map(|i| scanned + i) {
            if self.discarding {
                self.discarding = false;
            } else if end - start > max {
                f(Err(Reject::TooLong));
            } else if !f(Ok(&buf[start..end])) {
                stopped = true;
                break;
            }
            start = end + 1;
        }
        if stopped {
            // Scanned again from the held line next time.
            self.buf.drain(..start);
            self.scanned = 0;
            return true;
        }
        let tail = buf.len() - start;
        if self.discarding || tail > max {
            if !self.discarding {
                f(Err(Reject::TooLong));
                self.discarding = true;
            }
            self.buf.clear();
            self.scanned = 0;
        } else {
            self.buf.drain(..start);
            self.scanned = tail;
        }
        // Only reachable if the caller appended far more than `read_size`; give it back.
        let bound = self.max_line_bytes + self.read_size;
        if self.buf.capacity() > 2 * bound {
            self.buf.shrink_to(bound);
        }
        false
    }

    /// The most bytes one read may append: `read_size`, so that one read holds a bounded
    /// number of lines whatever the spare capacity.
    pub fn read_size(&self) -> usize {
        self.read_size
    }

    /// At end of stream: drains remaining complete lines, then reports a leftover partial line
    /// as `Err(Reject::Unterminated)` unless it is only whitespace or the rest of an over-long
    /// line (already reported). Leaves the buffer empty and ready for reuse.
    pub fn finish(&mut self, mut f: impl FnMut(Result<&[u8], Reject>)) {
        self.drain_lines(&mut f);
        if !self.discarding && self.buf.iter().any(|&b| !matches!(b, b' ' | b'\t' | b'\r')) {
            f(Err(Reject::Unterminated));
        }
        self.buf.clear();
        self.scanned = 0;
        self.discarding = false;
    }
}

/// Splits one datagram into lines: `\n`-separated, the last line may lack its `\n` (a
/// trailing `\n` does not produce an extra empty line). Lines longer than `max_line_bytes`
/// give `Err(TooLong)`.
pub fn datagram_lines<'a>(
    datagram: &'a [u8],
    max_line_bytes: usize,
    mut f: impl FnMut(Result<&'a [u8], Reject>),
) {
    let mut emit = |line: &'a [u8]| {
        if line.len() > max_line_bytes {
            f(Err(Reject::TooLong));
        } else {
            f(Ok(line));
        }
    };
    let mut start = 0;
    for end in memchr_iter(b'\n', datagram) {
        emit(&datagram[start..end]);
        start = end + 1;
    }
    if start < datagram.len() {
        emit(&datagram[start..]);
    }
}
