//! DogStatsD's Unix stream framing, bytes into packets: each packet is preceded by its length,
//! a little-endian u32 (the datadog clients' `unixstream://`, the Agent's `dogstatsd_stream_socket`).
//! A packet holds one or more statsd lines, as a datagram does.

use crate::socket::MAX_DATAGRAM;

const PREFIX: usize = 4;

/// A frame announced longer than [`MAX_DATAGRAM`]: the connection cannot be read further (what
/// follows cannot be told apart from the frame's bytes without reading them all).
#[derive(Debug, PartialEq, Eq)]
pub struct FrameTooLong(pub u32);

/// A stream connection's bytes not yet taken: at most one partial frame (bounded by
/// [`MAX_DATAGRAM`]) plus one read.
pub struct FrameBuffer {
    buf: Vec<u8>,
    /// Where the first frame not yet taken starts.
    start: usize,
    read_size: usize,
}

impl FrameBuffer {
    pub fn new(read_size: usize) -> FrameBuffer {
        FrameBuffer {
            buf: Vec::new(),
            start: 0,
            read_size,
        }
    }

    /// The most bytes the next read may append.
    pub fn read_size(&self) -> usize {
        self.read_size
    }

    /// Where the next read appends, with room for `read_size` bytes; the frames taken already
    /// are dropped first.
    pub fn read_buf(&mut self) -> &mut Vec<u8> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let len = self.buf.len();
        if self.buf.capacity() - len < self.read_size {
            // Straight to the bound, as `LineBuffer` does: one allocation for a busy stream.
            let target = len.max(PREFIX + MAX_DATAGRAM) + self.read_size;
            self.buf.reserve_exact(target - len);
        }
        &mut self.buf
    }

    /// Calls `f` with every complete packet in the buffer (empty ones skipped), in order. Stops
    /// at a frame announced longer than [`MAX_DATAGRAM`]: the error.
    pub fn drain_frames(&mut self, mut f: impl FnMut(&[u8])) -> Result<(), FrameTooLong> {
        while let Some(prefix) = self.buf.get(self.start..self.start + PREFIX) {
            let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes"));
            if len as usize > MAX_DATAGRAM {
                return Err(FrameTooLong(len));
            }
            let body = self.start + PREFIX;
            let Some(packet) = self.buf.get(body..body + len as usize) else {
                break;
            };
            if !packet.is_empty() {
                f(packet);
            }
            self.start = body + len as usize;
        }
        Ok(())
    }

    /// Whether part of a frame is left: at the end of a stream, a packet cut short.
    pub fn partial(&self) -> bool {
        self.buf.len() > self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(packet: &[u8]) -> Vec<u8> {
        let mut out = (packet.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(packet);
        out
    }

    fn feed(frames: &mut FrameBuffer, bytes: &[u8]) -> (Vec<Vec<u8>>, Result<(), FrameTooLong>) {
        frames.read_buf().extend_from_slice(bytes);
        let mut got = Vec::new();
        let r = frames.drain_frames(|p| got.push(p.to_vec()));
        (got, r)
    }

    #[test]
    fn packets_come_whole_whatever_the_reads_cut() {
        let stream: Vec<u8> = [&b"a:1|c\n"[..], b"", b"b:2|c\nc:3|c\n", &[b'x'; 300]]
            .iter()
            .flat_map(|p| frame(p))
            .collect();
        for cut in [1, 2, 3, 5, 7, 64, stream.len()] {
            let mut frames = FrameBuffer::new(cut);
            let mut got = Vec::new();
            for chunk in stream.chunks(cut) {
                let (packets, r) = feed(&mut frames, chunk);
                assert_eq!(r, Ok(()));
                got.extend(packets);
            }
            assert!(!frames.partial(), "cut {cut}");
            let want: Vec<Vec<u8>> = vec![
                b"a:1|c\n".to_vec(),
                b"b:2|c\nc:3|c\n".to_vec(),
                vec![b'x'; 300],
            ];
            assert_eq!(got, want, "cut {cut}");
        }
    }

    #[test]
    fn a_cut_frame_is_partial_and_an_oversized_one_is_refused() {
        let mut frames = FrameBuffer::new(4096);
        let bytes = frame(b"a:1|c");
        let (got, r) = feed(&mut frames, &bytes[..bytes.len() - 1]);
        assert!(got.is_empty() && r.is_ok() && frames.partial());

        let mut frames = FrameBuffer::new(4096);
        let largest = vec![b'y'; MAX_DATAGRAM];
        let (got, r) = feed(&mut frames, &frame(&largest));
        assert_eq!((got.len(), r), (1, Ok(())));
        let over = (MAX_DATAGRAM as u32 + 1).to_le_bytes();
        let (got, r) = feed(&mut frames, &[&frame(b"z:1|c")[..], &over].concat());
        assert_eq!(got, vec![b"z:1|c".to_vec()]);
        assert_eq!(r, Err(FrameTooLong(MAX_DATAGRAM as u32 + 1)));
    }
}
