//! Block hashing: the encoding is written straight into SHA-256's 64-byte blocks, so an
//! argument is hashed as it is encoded, without a buffer the size of the arguments.

/// Where the canonical encoding is written: a fingerprint's buffer, or a map's scratch
/// buffer (whose entries are sorted before they are copied to the fingerprint's).
pub(super) trait Sink {
    fn put(&mut self, bytes: &[u8]);
    fn put_byte(&mut self, byte: u8);
    /// A coarse point of the encoding (after a struct field, sequence element, map or
    /// argument), where a sink that hashes as it goes may hash a block: a check per write
    /// would cost more than the hashing it overlaps saves. Nothing for a map's scratch
    /// buffer, whose entries are reordered before they reach the fingerprint.
    #[inline]
    fn checkpoint(&mut self) {}
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.push(byte);
    }
}

thread_local! {
    /// The encoding buffer of this thread's last finished fingerprint, reused by the next:
    /// a typical request encodes to a few KiB, and growing a fresh buffer to that size costs
    /// as much as encoding it.
    static SPARE_BUFFER: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Buffers larger than this are freed rather than kept for the next fingerprint.
pub(super) const SPARE_BUFFER_LIMIT: usize = 64 * 1024;

/// A fingerprint's canonical bytes, in a buffer taken from this thread's spare, and the
/// SHA-256 of their first whole 64-byte blocks.
///
/// The bytes are hashed as the encoding goes, a block at a time, so that the processor runs
/// SHA-256 — bound by the latency of its SHA instructions — alongside the encoding rather
/// than after it (P5, issue 23: fingerprint / SHA-256 of its bytes 1.39 → 1.24):
/// - writes never check for a complete block (the encoder's cost is its number of writes:
///   a check per write measured slower); the encoder calls [`Sink::checkpoint`] at coarse
///   points instead, after each struct field, sequence element, map and argument;
/// - a checkpoint hashes one block, and only once a further whole block has been written
///   after it. Hashing the newest block at once (or all complete blocks at each
///   checkpoint) measured 1.30–1.33: most likely because the hash loads its block 16 bytes
///   at a time, and a load of bytes that narrower stores have only just written waits for
///   those stores to reach the cache instead of running ahead;
/// - blocks go to `sha2`'s compression function straight from the buffer (no copy to a
///   hasher's block buffer), and the bytes stay, so [`Fingerprinter::encoded`] has them all.
///
/// (A type of its own rather than a bare `Vec`: the encoder monomorphised for it measured
/// faster than the same code on the `Vec` that map scratch buffers use.)
#[derive(Clone)]
pub(super) struct Buffer {
    /// The canonical encoding so far.
    pub(super) bytes: Vec<u8>,
    /// SHA-256's chaining state after the first `hashed` bytes.
    pub(super) state: [u32; 8],
    /// How many bytes from the start are hashed into `state`: a multiple of [`BLOCK`].
    pub(super) hashed: usize,
}

/// SHA-256's block size.
pub(super) const BLOCK: usize = 64;

/// SHA-256's initial chaining state (FIPS 180-4, 5.3.3).
pub(super) const SHA256_INITIAL_STATE: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

impl Buffer {
    pub(super) fn new() -> Self {
        // While the thread is torn down there is no spare: a new buffer is grown instead.
        let mut bytes = SPARE_BUFFER
            .try_with(std::cell::Cell::take)
            .unwrap_or_default();
        bytes.clear();
        bytes.reserve(2048);
        Self {
            bytes,
            state: SHA256_INITIAL_STATE,
            hashed: 0,
        }
    }

    /// SHA-256 of all the bytes: the whole blocks not hashed yet, then the last, padded.
    pub(super) fn finish(mut self) -> [u8; 32] {
        let pending = self.bytes.get(self.hashed..).unwrap_or_default();
        let (blocks, tail) = pending.as_chunks::<BLOCK>();
        sha2::block_api::compress256(&mut self.state, blocks);
        // SHA-256's padding (FIPS 180-4, 5.1.1): the tail, a 1 bit, zeros, and the length
        // in bits as a big-endian u64 ending the last block — a second block when the
        // length does not fit after the 1 bit.
        let mut last = [[0_u8; BLOCK]; 2];
        let last_blocks = if tail.len() < BLOCK - 8 { 1 } else { 2 };
        let padded = last.as_flattened_mut();
        if let Some(start) = padded.get_mut(..tail.len()) {
            start.copy_from_slice(tail);
        }
        if let Some(one_bit) = padded.get_mut(tail.len()) {
            *one_bit = 0x80;
        }
        let bit_len = (self.bytes.len() as u64).wrapping_mul(8);
        if let Some(length) = padded
            .get_mut(..last_blocks * BLOCK)
            .and_then(<[u8]>::last_chunk_mut::<8>)
        {
            *length = bit_len.to_be_bytes();
        }
        sha2::block_api::compress256(&mut self.state, last.get(..last_blocks).unwrap_or(&last));
        let mut digest = [0_u8; 32];
        for (word, out) in self.state.iter().zip(digest.as_chunks_mut::<4>().0) {
            *out = word.to_be_bytes();
        }
        digest
    }
}

/// Gives the buffer back to this thread's spare, whether the fingerprint was finished or
/// dropped (an argument failed to serialize, or only [`Fingerprinter::encoded`] was wanted).
impl Drop for Buffer {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.bytes);
        if bytes.capacity() <= SPARE_BUFFER_LIMIT {
            let _ = SPARE_BUFFER.try_with(|spare| spare.set(bytes));
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.bytes.len())
    }
}

impl Sink for Buffer {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }
    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.bytes.push(byte);
    }
    /// Hashes the first block not hashed yet if a whole block has been written after it
    /// (see [`Buffer`] for why one, and why not the newest).
    #[inline]
    fn checkpoint(&mut self) {
        if let Some(block) = self
            .bytes
            .get(self.hashed..)
            .and_then(<[u8]>::first_chunk::<{ 2 * BLOCK }>)
            .and_then(|two_blocks| two_blocks.first_chunk::<BLOCK>())
        {
            sha2::block_api::compress256(&mut self.state, std::slice::from_ref(block));
            self.hashed += BLOCK;
        }
    }
}

thread_local! {
    /// Version 1's encoding buffer of this thread's last dropped call, reused by the next (as
    /// [`SPARE_BUFFER`] is for the hashed one): a call keeps it until it ends, to compare a
    /// record under version 1 if it meets one.
    static SPARE_V1: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Version 1's canonical bytes of a call, in a buffer taken from this thread's spare and
/// given back to the spare of the thread that drops it.
#[derive(Clone)]
pub(super) struct SpareBytes(pub(super) Vec<u8>);

impl SpareBytes {
    pub(super) fn new() -> Self {
        let mut bytes = SPARE_V1.try_with(std::cell::Cell::take).unwrap_or_default();
        bytes.clear();
        bytes.reserve(2048);
        Self(bytes)
    }
}

impl Drop for SpareBytes {
    fn drop(&mut self) {
        let bytes = std::mem::take(&mut self.0);
        if bytes.capacity() <= SPARE_BUFFER_LIMIT {
            let _ = SPARE_V1.try_with(|spare| spare.set(bytes));
        }
    }
}

impl std::fmt::Debug for SpareBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

impl Sink for SpareBytes {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }
    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.0.push(byte);
    }
}
