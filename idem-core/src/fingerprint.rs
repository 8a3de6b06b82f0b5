//! Canonical, versioned SHA-256 fingerprints of handler arguments.
//!
//! The arguments are encoded with a serde `Serializer` that writes a self-delimiting,
//! tagged binary form (not JSON text), so equal logical values give equal bytes:
//! - every integer width encodes the same (`5_u8` and `5_i64` are one value);
//! - `f32` widens to `f64`, `-0.0` equals `0.0`, every NaN is one NaN;
//! - map entries are sorted by their encoded key, so `HashMap` order never matters;
//! - `char` encodes as a one-character string; newtype structs as their content.
//!
//! Version 2 ([`FINGERPRINT_VERSION`]) also lets a request type evolve under recorded keys,
//! so a deploy does not turn an honest retry into `KeyReused`:
//! - a struct is a map of its field names: field order never matters, and a struct and a
//!   map with the same entries (a `#[serde(flatten)]`ed struct) are one value;
//! - a struct field whose value is `None` or unit (`()`, a unit struct, `PhantomData`) is
//!   left out, as if absent: adding an `Option` field that is `None` keeps the fingerprint.
//!   `Some(None)` is a value and stays. A map's entries all stay (a map's keys are data:
//!   `{"a": None}` is not `{}`);
//! - arguments are named ([`Fingerprinter::named`]; `#[idempotent]` names each by its
//!   parameter), encoded in order of name, and a named argument that is `None` or unit is
//!   left out: adding a parameter that is `None` or reordering parameters keeps it.
//!
//! "Default" means exactly that: absent, `None` or unit. A field that holds its type's
//! `Default` (`0`, `""`, `false`, an empty `Vec`) is a value a client may mean, and still
//! counts; a type that wants such a field left out says so with serde's
//! `#[serde(skip_serializing_if = "...")]`, which the fingerprint honours.
//!
//! Version 1 (`idem/fingerprint/v1`, [`FINGERPRINT_V1`]) kept struct fields in declaration
//! order, `None` fields in, and arguments unnamed. Records written under it keep matching
//! retries: a call's [`Fingerprints`] compare a recorded fingerprint under both versions. The
//! arguments are encoded once, in version 1's form (the input of both), and version 2 is
//! derived from those bytes; version 1's SHA-256 is only computed when a recorded fingerprint
//! is not version 2's. Each version's encoding starts with its tag, so no two versions can
//! ever compare equal by accident.
//!
//! Sequences keep their order: a `HashSet` argument has no stable order, so use a `BTreeSet`.

use std::sync::{Arc, OnceLock};

use serde::ser::{self, Serialize};

use crate::error::Error;

/// Version tag hashed in front of every fingerprint this release writes.
pub const FINGERPRINT_VERSION: &str = "idem/fingerprint/v2";

/// Version tag of the first encoding, whose records this release still matches.
pub const FINGERPRINT_V1: &str = "idem/fingerprint/v1";

/// A SHA-256 fingerprint of a call's scope and arguments.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Builds a [`Fingerprint`] from a scope and a list of arguments.
///
/// ```
/// # use idem_core::Fingerprinter;
/// let mut a = Fingerprinter::new("orders.pay");
/// a.named("customer", "c-1").unwrap();
/// a.named("amount", &1200_u32).unwrap();
/// let mut b = Fingerprinter::new("orders.pay");
/// b.named("amount", &1200_u64).unwrap();
/// b.named("customer", "c-1").unwrap();
/// b.named("note", &None::<String>).unwrap();
/// assert_eq!(a.finish(), b.finish());
/// ```
#[derive(Debug, Clone)]
pub struct Fingerprinter {
    /// Version 1's encoding of the header and the arguments so far: what version 1 hashes,
    /// and what version 2 is derived from.
    encoded: SpareBytes,
    /// Where the scope starts and the arguments start in `encoded`.
    scope_at: usize,
    args_at: usize,
    /// Each argument: its name (`""` when unnamed) and where its encoding starts.
    args: Vec<(&'static str, usize)>,
    /// Version 1's encoding where it differs from `encoded` ([`changed`](Self::changed)).
    v1: Option<Vec<u8>>,
}

impl Fingerprinter {
    /// Starts a fingerprint for `scope`.
    pub fn new(scope: &str) -> Self {
        let mut encoded = SpareBytes::new();
        put_str(&mut encoded, FINGERPRINT_V1);
        let scope_at = encoded.0.len();
        put_str(&mut encoded, scope);
        let args_at = encoded.0.len();
        Self {
            encoded,
            scope_at,
            args_at,
            args: Vec::new(),
            v1: None,
        }
    }

    /// Adds an unnamed argument: it keeps its place among the unnamed ones (before the named
    /// ones) and is never left out, whatever its value.
    pub fn arg<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FingerprintError> {
        self.named("", value)
    }

    /// Adds the argument `name`: arguments are fingerprinted in order of name, and one whose
    /// value is `None` or unit is left out (as if the handler did not take it). `name` must
    /// not be empty (the empty name is [`arg`](Self::arg)'s).
    pub fn named<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.args.push((name, self.encoded.0.len()));
        let result = value.serialize(&mut Canonical {
            out: &mut self.encoded,
        });
        if let Some(v1) = &mut self.v1 {
            let start = self.args.last().map_or(0, |&(_, start)| start);
            v1.extend_from_slice(self.encoded.0.get(start..).unwrap_or_default());
        }
        result
    }

    /// Adds the argument `name` as `current`, where version 1 fingerprinted `v1` in its
    /// place: for a caller whose input changed form with version 2 (the tower layer
    /// fingerprints a JSON body canonicalised now, its raw bytes before), so records it wrote
    /// under version 1 keep matching.
    pub fn changed<C: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        current: &C,
        v1: &V,
    ) -> Result<(), FingerprintError> {
        let mut old = self.v1.take().unwrap_or_else(|| self.encoded.0.clone());
        let result = v1.serialize(&mut Canonical { out: &mut old });
        self.v1 = Some(old);
        result?;
        self.args.push((name, self.encoded.0.len()));
        value_into(current, &mut self.encoded)
    }

    /// The canonical bytes of everything added (what [`finish`](Self::finish) hashes).
    pub fn encoded(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_current(&mut out);
        out
    }

    /// Version 1's canonical bytes of everything added (what [`Fingerprints::v1`] hashes).
    pub fn encoded_v1(&self) -> &[u8] {
        self.v1.as_deref().unwrap_or(&self.encoded.0)
    }

    /// Hashes everything added: the fingerprint a record is written with.
    pub fn finish(self) -> Fingerprint {
        let mut out = Buffer::new();
        self.write_current(&mut out);
        Fingerprint(out.finish())
    }

    /// Hashes everything added under the current version, and keeps what version 1 needs to
    /// compare a record an earlier release wrote.
    pub fn finish_versions(self) -> Fingerprints {
        let mut out = Buffer::new();
        self.write_current(&mut out);
        let current = Fingerprint(out.finish());
        let bytes = match self.v1 {
            Some(v1) => SpareBytes(v1),
            None => self.encoded,
        };
        Fingerprints {
            current,
            v1: Arc::new(V1 {
                bytes,
                digest: OnceLock::new(),
            }),
        }
    }

    /// Writes the current version's encoding: its tag, the scope, then each argument in
    /// order of name (a stable order: unnamed ones keep theirs), its name and its value,
    /// derived from version 1's bytes ([`Upgrade`]).
    fn write_current<S: Sink>(&self, out: &mut S) {
        let bytes = &self.encoded.0;
        put_str(out, FINGERPRINT_VERSION);
        out.put(bytes.get(self.scope_at..self.args_at).unwrap_or_default());
        let ends = self
            .args
            .iter()
            .skip(1)
            .map(|&(_, start)| start)
            .chain([bytes.len()]);
        let mut args: Vec<(&str, usize, usize)> = self
            .args
            .iter()
            .zip(ends)
            .map(|(&(name, start), end)| (name, start, end))
            .collect();
        args.sort_by(|a, b| a.0.cmp(b.0));
        let mut upgrade = Upgrade::new(bytes, out);
        for (name, start, end) in args {
            if !name.is_empty() && bytes.get(start..end) == Some(&[tag::UNIT]) {
                continue;
            }
            put_str(upgrade.out, name);
            upgrade.value(start);
            upgrade.out.checkpoint();
        }
        upgrade.give_back();
    }
}

/// Encodes one value in version 1's form onto `out`.
fn value_into<T: Serialize + ?Sized>(
    value: &T,
    out: &mut impl Sink,
) -> Result<(), FingerprintError> {
    value.serialize(&mut Canonical { out })
}

/// A call's fingerprint under the current version, and under version 1 for the records an
/// earlier release wrote: computed once, when a recorded fingerprint is not the current one
/// (so a call that meets no record, or a current one, never hashes twice). Cheap to clone.
#[derive(Clone, Debug)]
pub struct Fingerprints {
    current: Fingerprint,
    v1: Arc<V1>,
}

/// Version 1's canonical bytes, and their SHA-256 once asked for.
#[derive(Debug)]
struct V1 {
    bytes: SpareBytes,
    digest: OnceLock<Fingerprint>,
}

impl Fingerprints {
    /// The fingerprint under the current version: the one a record is written with.
    pub fn current(&self) -> Fingerprint {
        self.current
    }

    /// The fingerprint version 1 gave the same call.
    pub fn v1(&self) -> Fingerprint {
        *self.v1.digest.get_or_init(|| {
            use sha2::Digest;
            Fingerprint(sha2::Sha256::digest(&self.v1.bytes.0).into())
        })
    }

    /// Whether a record fingerprinted `recorded` (under either version) was written for
    /// these arguments.
    pub fn matches(&self, recorded: &Fingerprint) -> bool {
        *recorded == self.current || *recorded == self.v1()
    }
}

/// Canonical encoding of one value (the current version), for tests and tools.
pub fn canonical_bytes<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
    let mut v1 = Vec::new();
    value_into(value, &mut v1)?;
    let mut out = Vec::new();
    let mut upgrade = Upgrade::new(&v1, &mut out);
    upgrade.value(0);
    upgrade.give_back();
    Ok(out)
}

/// Version 1's canonical encoding of one value, for tests and tools.
pub fn canonical_bytes_v1<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, FingerprintError> {
    let mut out = Vec::new();
    value_into(value, &mut out)?;
    Ok(out)
}

/// Where the canonical encoding is written: a fingerprint's buffer, or a map's scratch
/// buffer (whose entries are sorted before they are copied to the fingerprint's).
trait Sink {
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
const SPARE_BUFFER_LIMIT: usize = 64 * 1024;

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
struct Buffer {
    /// The canonical encoding so far.
    bytes: Vec<u8>,
    /// SHA-256's chaining state after the first `hashed` bytes.
    state: [u32; 8],
    /// How many bytes from the start are hashed into `state`: a multiple of [`BLOCK`].
    hashed: usize,
}

/// SHA-256's block size.
const BLOCK: usize = 64;

/// SHA-256's initial chaining state (FIPS 180-4, 5.3.3).
const SHA256_INITIAL_STATE: [u32; 8] = [
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
    fn new() -> Self {
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
    fn finish(mut self) -> [u8; 32] {
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
struct SpareBytes(Vec<u8>);

impl SpareBytes {
    fn new() -> Self {
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

/// One entry of a map or struct being upgraded: offsets in version 1's bytes of its key, its
/// value and its end, and whether each reads the same in both versions.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: usize,
    value: usize,
    end: usize,
    plain_key: bool,
    plain_value: bool,
}

thread_local! {
    /// The entry stack of this thread's last upgrade, reused by the next.
    static SPARE_ENTRIES: std::cell::Cell<Vec<Entry>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Derives version 2's encoding of values from version 1's bytes (the module docs say what
/// changes): structs become maps sorted by field name, without their `None` and unit fields;
/// everything else is copied as it is. A value that holds no struct or map ("plain") reads
/// the same in both versions and is copied in one piece.
///
/// It reads only bytes [`Canonical`] wrote; bytes it cannot read (a truncated token, an
/// unknown tag) are copied as they are rather than panicking: the result is still a pure
/// function of the input.
struct Upgrade<'a, S> {
    bytes: &'a [u8],
    out: &'a mut S,
    /// The entries of every map and struct open on the way down, a level's above its
    /// parent's.
    entries: Vec<Entry>,
}

impl<'a, S: Sink> Upgrade<'a, S> {
    fn new(bytes: &'a [u8], out: &'a mut S) -> Self {
        let entries = SPARE_ENTRIES
            .try_with(std::cell::Cell::take)
            .unwrap_or_default();
        Self {
            bytes,
            out,
            entries,
        }
    }

    /// Keeps the entry stack for this thread's next upgrade.
    fn give_back(mut self) {
        self.entries.clear();
        let entries = std::mem::take(&mut self.entries);
        let _ = SPARE_ENTRIES.try_with(|spare| spare.set(entries));
    }

    fn byte(&self, at: usize) -> Option<u8> {
        self.bytes.get(at).copied()
    }

    fn copy(&mut self, from: usize, to: usize) {
        self.out.put(
            self.bytes
                .get(from..to.min(self.bytes.len()))
                .unwrap_or_default(),
        );
    }

    /// Where the value at `at` ends, and whether it is plain.
    fn skip(&self, at: usize) -> (usize, bool) {
        let end = self.bytes.len();
        let fixed = |len: usize| (at.saturating_add(len).min(end), true);
        match self.byte(at) {
            Some(tag::UNIT | tag::FALSE | tag::TRUE) => fixed(1),
            Some(tag::INT) => fixed(18),
            Some(tag::FLOAT) => fixed(9),
            Some(tag::STR | tag::BYTES) => {
                let len = self
                    .bytes
                    .get(at + 1..)
                    .and_then(<[u8]>::first_chunk::<8>)
                    .map_or(usize::MAX, |len| {
                        usize::try_from(u64::from_be_bytes(*len)).unwrap_or(usize::MAX)
                    });
                fixed(len.saturating_add(9))
            }
            Some(tag::SOME) => self.skip(at + 1),
            Some(tag::VARIANT) => self.skip(self.skip(at + 1).0),
            Some(tag::SEQ) => {
                let (mut next, mut plain) = (at + 1, true);
                while next < end && self.byte(next) != Some(tag::END) {
                    let (value_end, value_plain) = self.skip(next);
                    (next, plain) = (value_end, plain && value_plain);
                }
                ((next + 1).min(end), plain)
            }
            Some(tag::MAP | tag::STRUCT) => {
                let mut next = at + 1;
                while next < end && self.byte(next) != Some(tag::END) {
                    next = self.skip(self.skip(next).0).0;
                }
                ((next + 1).min(end), false)
            }
            _ => (end, true),
        }
    }

    /// Writes the value at `at`; returns where it ends.
    fn value(&mut self, at: usize) -> usize {
        let (end, plain) = self.skip(at);
        self.known(at, end, plain);
        end
    }

    /// Writes the value at `at`, which ends at `end`.
    fn known(&mut self, at: usize, end: usize, plain: bool) {
        if plain {
            return self.copy(at, end);
        }
        match self.byte(at) {
            Some(tag::SOME) => {
                self.out.put_byte(tag::SOME);
                self.value(at + 1);
            }
            Some(tag::VARIANT) => {
                let name_end = self.skip(at + 1).0;
                self.copy(at, name_end);
                self.value(name_end);
            }
            Some(tag::SEQ) => {
                self.out.put_byte(tag::SEQ);
                let mut next = at + 1;
                while next < end && self.byte(next) != Some(tag::END) {
                    next = self.value(next);
                    self.out.checkpoint();
                }
                self.out.put_byte(tag::END);
            }
            Some(tag::MAP) => self.entries(at, end, false),
            Some(tag::STRUCT) => self.entries(at, end, true),
            _ => self.copy(at, end),
        }
    }

    /// The encoded key of an entry (a struct's field name as a string).
    fn key(&self, entry: &Entry) -> &'a [u8] {
        self.bytes.get(entry.key..entry.value).unwrap_or_default()
    }

    /// Writes the map or struct at `at` as a map: a struct's fields sorted like a map's keys
    /// and those that are `None` or unit left out.
    fn entries(&mut self, at: usize, end: usize, is_struct: bool) {
        let base = self.entries.len();
        let (mut next, mut sorted, mut plain_keys) = (at + 1, true, true);
        while next < end && self.byte(next) != Some(tag::END) {
            let (value, plain_key) = self.skip(next);
            let (entry_end, plain_value) = self.skip(value);
            let entry = Entry {
                key: next,
                value,
                end: entry_end,
                plain_key,
                plain_value,
            };
            next = entry_end;
            if is_struct && self.bytes.get(value..entry_end) == Some(&[tag::UNIT]) {
                continue;
            }
            if let Some(last) = self.entries.get(base..).and_then(<[Entry]>::last) {
                sorted &= self.key(last) <= self.key(&entry);
            }
            plain_keys &= plain_key;
            self.entries.push(entry);
        }
        let count = self.entries.len() - base;
        // A map's entries are in version 1's order, by encoded key: the same order in
        // version 2 unless a key holds a struct or map (whose encoding changed).
        if is_struct && !sorted {
            let bytes = self.bytes;
            let key = |e: &Entry| bytes.get(e.key..e.value).unwrap_or_default();
            if let Some(level) = self.entries.get_mut(base..) {
                level.sort_by(|a, b| key(a).cmp(key(b)));
            }
        } else if !plain_keys {
            self.sort_by_upgraded_keys(base);
        }
        self.out.put_byte(tag::MAP);
        for i in base..base + count {
            let Some(&entry) = self.entries.get(i) else {
                break;
            };
            if entry.plain_key && entry.plain_value {
                self.copy(entry.key, entry.end);
            } else {
                self.known(entry.key, entry.value, entry.plain_key);
                self.known(entry.value, entry.end, entry.plain_value);
            }
            self.out.checkpoint();
        }
        self.out.put_byte(tag::END);
        self.entries.truncate(base);
    }

    /// Sorts the entries from `base` by their keys' version 2 encoding (a map keyed by
    /// structs or maps: rare, so the keys are encoded twice).
    fn sort_by_upgraded_keys(&mut self, base: usize) {
        let bytes = self.bytes;
        let Some(level) = self.entries.get_mut(base..) else {
            return;
        };
        let mut keyed: Vec<(Vec<u8>, Entry)> = level
            .iter()
            .map(|entry| {
                let mut key = Vec::new();
                let mut upgrade = Upgrade {
                    bytes,
                    out: &mut key,
                    entries: Vec::new(),
                };
                upgrade.known(entry.key, entry.value, entry.plain_key);
                (key, *entry)
            })
            .collect();
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        for (slot, (_, entry)) in level.iter_mut().zip(keyed) {
            *slot = entry;
        }
    }
}

/// The `Serialize` impl of an argument failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(String);

impl std::fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FingerprintError {}

impl ser::Error for FingerprintError {
    fn custom<M: std::fmt::Display>(msg: M) -> Self {
        Self(msg.to_string())
    }
}

impl FingerprintError {
    pub(crate) fn into_error(self, scope: &str) -> Error {
        Error::Fingerprint {
            scope: scope.to_owned(),
            message: self.0,
        }
    }
}

/// The byte before each value of the canonical encoding. Frozen: a change is a new
/// `FINGERPRINT_VERSION`.
mod tag {
    macro_rules! tags {
        ($($name:ident = $byte:literal),+) => { $(pub(super) const $name: u8 = $byte;)+ };
    }
    tags!(
        UNIT = 0x00,
        SOME = 0x01,
        FALSE = 0x02,
        TRUE = 0x03,
        INT = 0x04,
        FLOAT = 0x05,
        STR = 0x06,
        BYTES = 0x07,
        SEQ = 0x08,
        MAP = 0x09,
        STRUCT = 0x0a,
        VARIANT = 0x0b,
        END = 0x0c
    );
}

// Each token is written with one copy of a stack array: the encoder's cost is its number of
// writes, not its bytes.
/// A tag and a length, as one write.
#[inline]
fn put_header(out: &mut impl Sink, tag: u8, len: usize) {
    let mut header = [tag; 9];
    header[1..].copy_from_slice(&(len as u64).to_be_bytes());
    out.put(&header);
}

#[inline]
fn put_str(out: &mut impl Sink, s: &str) {
    put_header(out, tag::STR, s.len());
    out.put(s.as_bytes());
}

fn put_int(out: &mut impl Sink, negative: bool, magnitude: u128) {
    let mut token = [tag::INT; 18];
    token[1] = u8::from(negative && magnitude != 0);
    token[2..].copy_from_slice(&magnitude.to_be_bytes());
    out.put(&token);
}

fn put_signed(out: &mut impl Sink, v: i128) {
    put_int(out, v < 0, v.unsigned_abs());
}

fn put_unsigned(out: &mut impl Sink, v: u128) {
    put_int(out, false, v);
}

fn put_float(out: &mut impl Sink, v: f64) {
    let canonical = if v.is_nan() {
        f64::NAN.to_bits()
    } else if v == 0.0 {
        0.0_f64.to_bits()
    } else {
        v.to_bits()
    };
    let mut token = [tag::FLOAT; 9];
    token[1..].copy_from_slice(&canonical.to_be_bytes());
    out.put(&token);
}

/// The canonical serializer, writing to `out`.
struct Canonical<'a, S> {
    out: &'a mut S,
}

/// Writes a map's entries to a scratch buffer of its own as they come, then to `out` in the
/// canonical order (by encoded key) when the map ends.
struct MapEncoder<'a, S> {
    out: &'a mut S,
    scratch: MapScratch,
}

/// A map's entries before they are sorted.
#[derive(Default)]
struct MapScratch {
    bytes: Vec<u8>,
    /// Each entry as offsets in `bytes`: key start, key end (its value's start), value end.
    entries: Vec<(usize, usize, usize)>,
}

thread_local! {
    /// Scratch buffers of finished maps, reused by the next: growing fresh ones for every
    /// map would cost as much as encoding it. One per level of nesting.
    static MAP_SCRATCH: std::cell::RefCell<Vec<MapScratch>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Scratch buffers larger than this are freed rather than kept for the next map.
const MAP_SCRATCH_LIMIT: usize = 64 * 1024;
/// Levels of map nesting whose scratch buffers are kept.
const MAP_SCRATCH_DEPTH: usize = 8;

impl MapScratch {
    /// An empty scratch buffer, reused if this thread has one.
    fn take() -> Self {
        MAP_SCRATCH
            .try_with(|pool| pool.try_borrow_mut().ok()?.pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Keeps this buffer for the next map on this thread, unless it is too large to keep.
    fn give_back(mut self) {
        if self.bytes.capacity() > MAP_SCRATCH_LIMIT {
            return;
        }
        self.bytes.clear();
        self.entries.clear();
        // During the thread's teardown the pool is gone: the buffer is simply freed.
        let _ = MAP_SCRATCH.try_with(|pool| {
            if let Ok(mut pool) = pool.try_borrow_mut()
                && pool.len() < MAP_SCRATCH_DEPTH
            {
                pool.push(self);
            }
        });
    }
}

/// Serializer methods that put a number with `$put`, widened to its largest type.
macro_rules! numbers {
    ($($($method:ident($ty:ty)),+ => $put:ident;)+) => {$($(
        fn $method(self, v: $ty) -> Result<(), FingerprintError> {
            $put(self.out, v.into());
            Ok(())
        }
    )+)+};
}

impl<S: Sink> Canonical<'_, S> {
    /// Opens an enum variant's value: its name, then `value_tag` (unit, sequence or struct).
    fn variant(&mut self, variant: &str, value_tag: u8) -> &mut Self {
        self.out.put_byte(tag::VARIANT);
        put_str(self.out, variant);
        self.out.put_byte(value_tag);
        self
    }
}

impl<'a, S: Sink> ser::Serializer for &'a mut Canonical<'_, S> {
    type Ok = ();
    type Error = FingerprintError;
    type SerializeSeq = Self;
    type SerializeTuple = Self;
    type SerializeTupleStruct = Self;
    type SerializeTupleVariant = Self;
    type SerializeMap = MapEncoder<'a, S>;
    type SerializeStruct = Self;
    type SerializeStructVariant = Self;

    fn serialize_bool(self, v: bool) -> Result<(), FingerprintError> {
        self.out.put_byte(if v { tag::TRUE } else { tag::FALSE });
        Ok(())
    }
    // Every integer widens to one encoding and every float to another: the width a caller
    // chose never changes a fingerprint.
    numbers! {
        serialize_i8(i8), serialize_i16(i16), serialize_i32(i32), serialize_i64(i64),
        serialize_i128(i128) => put_signed;
        serialize_u8(u8), serialize_u16(u16), serialize_u32(u32), serialize_u64(u64),
        serialize_u128(u128) => put_unsigned;
        serialize_f32(f32), serialize_f64(f64) => put_float;
    }
    fn serialize_char(self, v: char) -> Result<(), FingerprintError> {
        put_str(self.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), FingerprintError> {
        put_str(self.out, v);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), FingerprintError> {
        put_header(self.out, tag::BYTES, v.len());
        self.out.put(v);
        Ok(())
    }
    fn serialize_none(self) -> Result<(), FingerprintError> {
        self.out.put_byte(tag::UNIT);
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), FingerprintError> {
        self.out.put_byte(tag::SOME);
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), FingerprintError> {
        self.out.put_byte(tag::UNIT);
        Ok(())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), FingerprintError> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<(), FingerprintError> {
        self.variant(variant, tag::UNIT);
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        self.out.put_byte(tag::VARIANT);
        put_str(self.out, variant);
        value.serialize(self)
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Self, FingerprintError> {
        self.out.put_byte(tag::SEQ);
        Ok(self)
    }
    fn serialize_tuple(self, _len: usize) -> Result<Self, FingerprintError> {
        self.out.put_byte(tag::SEQ);
        Ok(self)
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<Self, FingerprintError> {
        self.out.put_byte(tag::SEQ);
        Ok(self)
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self, FingerprintError> {
        Ok(self.variant(variant, tag::SEQ))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<MapEncoder<'a, S>, FingerprintError> {
        self.out.put_byte(tag::MAP);
        Ok(MapEncoder {
            out: self.out,
            scratch: MapScratch::take(),
        })
    }
    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<Self, FingerprintError> {
        self.out.put_byte(tag::STRUCT);
        Ok(self)
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Self, FingerprintError> {
        Ok(self.variant(variant, tag::STRUCT))
    }
}

impl<S: Sink> Canonical<'_, S> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FingerprintError> {
        value.serialize(&mut *self)?;
        self.out.checkpoint();
        Ok(())
    }
    fn field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        put_str(self.out, key);
        value.serialize(&mut *self)?;
        self.out.checkpoint();
        Ok(())
    }
    fn end(&mut self) -> Result<(), FingerprintError> {
        self.out.put_byte(tag::END);
        Ok(())
    }
}

macro_rules! sequence_like {
    ($($trait:ident :: $method:ident),*) => {$(
        impl<S: Sink> ser::$trait for &mut Canonical<'_, S> {
            type Ok = ();
            type Error = FingerprintError;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), FingerprintError> {
                self.element(value)
            }
            fn end(self) -> Result<(), FingerprintError> {
                Canonical::end(self)
            }
        }
    )*};
}
sequence_like!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

macro_rules! struct_like {
    ($($trait:ident),*) => {$(
        impl<S: Sink> ser::$trait for &mut Canonical<'_, S> {
            type Ok = ();
            type Error = FingerprintError;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), FingerprintError> {
                self.field(key, value)
            }
            fn end(self) -> Result<(), FingerprintError> {
                Canonical::end(self)
            }
        }
    )*};
}
struct_like!(SerializeStruct, SerializeStructVariant);

impl<S: Sink> ser::SerializeMap for MapEncoder<'_, S> {
    type Ok = ();
    type Error = FingerprintError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), FingerprintError> {
        let bytes = &mut self.scratch.bytes;
        let key_start = bytes.len();
        key.serialize(&mut Canonical { out: &mut *bytes })?;
        let key_end = bytes.len();
        self.scratch.entries.push((key_start, key_end, key_end));
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        if self.scratch.entries.is_empty() {
            return Err(FingerprintError(
                "map value serialized before its key".to_owned(),
            ));
        }
        let bytes = &mut self.scratch.bytes;
        value.serialize(&mut Canonical { out: &mut *bytes })?;
        let value_end = bytes.len();
        if let Some(entry) = self.scratch.entries.last_mut() {
            entry.2 = value_end;
        }
        Ok(())
    }
    fn end(mut self) -> Result<(), FingerprintError> {
        // Entries are written as they come; the canonical order is by encoded key. (Already
        // sorted, as a `BTreeMap`'s are, the sort only checks.)
        let MapScratch { bytes, entries } = &mut self.scratch;
        let key = |&(key_start, key_end, _): &(usize, usize, usize)| {
            bytes.get(key_start..key_end).unwrap_or_default()
        };
        entries.sort_unstable_by(|a, b| key(a).cmp(key(b)));
        for &(key_start, _, value_end) in entries.iter() {
            self.out
                .put(bytes.get(key_start..value_end).unwrap_or_default());
        }
        self.out.put_byte(tag::END);
        self.out.checkpoint();
        self.scratch.give_back();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap};

    fn fp<T: Serialize>(v: &T) -> Fingerprint {
        let mut f = Fingerprinter::new("s");
        f.arg(v).unwrap();
        f.finish()
    }

    #[derive(serde::Serialize)]
    struct Pay {
        order: u64,
        amount: i32,
        note: Option<String>,
        tags: BTreeMap<String, f64>,
    }

    #[test]
    fn scope_and_argument_boundaries_matter() {
        let mut a = Fingerprinter::new("a");
        a.arg("bc").unwrap();
        let mut b = Fingerprinter::new("ab");
        b.arg("c").unwrap();
        assert_ne!(a.finish(), b.finish());

        let mut one = Fingerprinter::new("s");
        one.arg("ab").unwrap();
        one.arg("").unwrap();
        let mut two = Fingerprinter::new("s");
        two.arg("a").unwrap();
        two.arg("b").unwrap();
        assert_ne!(one.finish(), two.finish());
    }

    #[test]
    fn numbers_are_canonical_across_widths() {
        assert_eq!(fp(&5_u8), fp(&5_i64));
        assert_eq!(fp(&-1_i8), fp(&-1_i128));
        assert_eq!(fp(&1.5_f32), fp(&1.5_f64));
        assert_eq!(fp(&-0.0_f64), fp(&0.0_f64));
        assert_eq!(fp(&f64::NAN), fp(&-f64::NAN));
        assert_ne!(fp(&1_u32), fp(&1.0_f64));
        assert_ne!(fp(&-1_i32), fp(&1_i32));
        assert_eq!(fp(&'x'), fp(&"x"));
    }

    #[test]
    fn options_and_variants_are_distinct() {
        assert_ne!(fp(&Some(())), fp(&None::<()>));
        assert_ne!(fp(&Some(0_u8)), fp(&0_u8));
        assert_ne!(fp(&Ok::<u8, u8>(1)), fp(&Err::<u8, u8>(1)));
    }

    #[test]
    fn struct_fields_are_named() {
        let a = Pay {
            order: 1,
            amount: 2,
            note: None,
            tags: BTreeMap::new(),
        };
        let b = Pay {
            order: 2,
            amount: 1,
            note: None,
            tags: BTreeMap::new(),
        };
        assert_ne!(fp(&a), fp(&b));
    }

    /// The fingerprint hashed as it is encoded must be SHA-256 of the canonical bytes.
    fn assert_streamed_hash_is_sha256_of_encoded(f: Fingerprinter) {
        use sha2::{Digest, Sha256};
        let expected: [u8; 32] = Sha256::digest(f.encoded()).into();
        let len = f.encoded().len();
        assert_eq!(f.finish().0, expected, "{len} canonical bytes");
    }

    #[derive(serde::Serialize)]
    enum Shape {
        Unit,
        Newtype(Option<i64>),
        Tuple(u8, String),
        Fields {
            name: String,
            nested: BTreeMap<String, Vec<Option<Shape>>>,
        },
    }

    #[test]
    fn every_padding_length_hashes_like_sha256() {
        // Encodings of every length over a few blocks: the last block's padding takes every
        // form (room for the length after the 1 bit or not, an empty last block).
        for len in 0..400 {
            let mut f = Fingerprinter::new("s");
            f.arg(&"x".repeat(len)).unwrap();
            assert_streamed_hash_is_sha256_of_encoded(f);
            let mut f = Fingerprinter::new("s");
            f.arg(&(0..len).map(|i| "y".repeat(i % 7)).collect::<Vec<_>>())
                .unwrap();
            assert_streamed_hash_is_sha256_of_encoded(f);
        }
    }

    #[test]
    fn varied_values_hash_like_sha256() {
        let mut hashed: HashMap<String, BTreeMap<String, Vec<Option<Shape>>>> = HashMap::new();
        for i in 0..30_u8 {
            let mut nested = BTreeMap::new();
            nested.insert(
                format!("k{i}").repeat(usize::from(i)),
                vec![
                    Some(Shape::Unit),
                    None,
                    Some(Shape::Newtype(Some(-i64::from(i)))),
                    Some(Shape::Tuple(i, "t".repeat(usize::from(i) * 5))),
                ],
            );
            hashed.insert(format!("outer {i}"), nested);
        }
        let mut f = Fingerprinter::new("varied");
        f.arg(&hashed).unwrap();
        f.arg(&Shape::Fields {
            name: "n".repeat(5000),
            nested: BTreeMap::new(),
        })
        .unwrap();
        f.arg(&(0..2000_i128).map(|i| i * i - 7).collect::<Vec<_>>())
            .unwrap();
        f.arg(&(Some(1.5_f64), None::<u8>, 'é', vec![Some(true), None]))
            .unwrap();
        f.arg(&Pay {
            order: 9,
            amount: -3,
            note: Some("z".repeat(200)),
            tags: [("a".to_owned(), 0.5), ("bb".to_owned(), -0.0)].into(),
        })
        .unwrap();
        assert_streamed_hash_is_sha256_of_encoded(f);
    }

    #[test]
    fn a_dropped_fingerprinter_leaves_the_next_one_intact() {
        let mut dropped = Fingerprinter::new("s");
        dropped.arg(&"left behind".repeat(100)).unwrap();
        drop(dropped);
        let mut f = Fingerprinter::new("s");
        f.arg(&1_u8).unwrap();
        assert_eq!(
            f.encoded(),
            [
                Fingerprinter::new("s").encoded(),
                canonical_bytes("").unwrap(),
                canonical_bytes(&1_u8).unwrap()
            ]
            .concat()
        );
        assert_streamed_hash_is_sha256_of_encoded(f);
    }

    /// A command as version A of a service declares it, and as version B after a deploy that
    /// reordered its fields and added optional ones.
    mod versions {
        #[derive(serde::Serialize)]
        pub(super) struct PayA {
            pub(super) order: u64,
            pub(super) amount: i32,
            pub(super) method: Method,
        }

        #[derive(serde::Serialize)]
        pub(super) struct PayB {
            pub(super) note: Option<String>,
            pub(super) amount: i32,
            pub(super) method: Method,
            pub(super) order: u64,
            pub(super) marker: (),
            pub(super) hint: Option<Option<u8>>,
        }

        #[derive(serde::Serialize)]
        pub(super) enum Method {
            Card {
                last4: String,
                brand: Option<String>,
            },
        }
    }

    fn version_a(last4: &str) -> versions::PayA {
        versions::PayA {
            order: 7,
            amount: 1200,
            method: versions::Method::Card {
                last4: last4.to_owned(),
                brand: None,
            },
        }
    }

    fn version_b(note: Option<&str>, hint: Option<Option<u8>>) -> versions::PayB {
        versions::PayB {
            note: note.map(str::to_owned),
            amount: 1200,
            method: versions::Method::Card {
                last4: "4242".to_owned(),
                brand: None,
            },
            order: 7,
            marker: (),
            hint,
        }
    }

    #[test]
    fn reordered_fields_and_added_options_keep_the_fingerprint() {
        assert_eq!(fp(&version_a("4242")), fp(&version_b(None, None)));
        assert_eq!(
            canonical_bytes(&version_a("4242")).unwrap(),
            canonical_bytes(&version_b(None, None)).unwrap()
        );
    }

    #[test]
    fn an_added_field_with_a_value_still_changes_the_fingerprint() {
        assert_ne!(fp(&version_a("4242")), fp(&version_b(Some(""), None)));
        assert_ne!(fp(&version_a("4242")), fp(&version_b(None, Some(None))));
        assert_ne!(
            fp(&version_b(None, Some(None))),
            fp(&version_b(None, Some(Some(0))))
        );
        assert_ne!(fp(&version_a("4242")), fp(&version_a("4343")));
    }

    #[test]
    fn an_added_argument_that_is_none_and_reordered_arguments_keep_the_fingerprint() {
        let mut a = Fingerprinter::new("s");
        a.named("cmd", &version_a("4242")).unwrap();
        a.named("tenant", "t-1").unwrap();
        let mut b = Fingerprinter::new("s");
        b.named("tenant", "t-1").unwrap();
        b.named("coupon", &None::<String>).unwrap();
        b.named("cmd", &version_b(None, None)).unwrap();
        assert_eq!(a.clone().finish(), b.finish());

        let mut c = Fingerprinter::new("s");
        c.named("cmd", &version_a("4242")).unwrap();
        c.named("tenant", "t-1").unwrap();
        c.named("coupon", &Some("SPRING")).unwrap();
        assert_ne!(a.clone().finish(), c.finish());
        // Unnamed arguments keep their places and are never left out.
        let mut d = Fingerprinter::new("s");
        d.arg(&None::<u8>).unwrap();
        d.arg(&Some(1_u8)).unwrap();
        let mut e = Fingerprinter::new("s");
        e.arg(&Some(1_u8)).unwrap();
        e.arg(&None::<u8>).unwrap();
        assert_ne!(d.finish(), e.finish());
        // Two optional arguments: which one is `None` matters.
        let mut x = Fingerprinter::new("s");
        x.named("first", &None::<u8>).unwrap();
        x.named("second", &Some(1_u8)).unwrap();
        let mut y = Fingerprinter::new("s");
        y.named("first", &Some(1_u8)).unwrap();
        y.named("second", &None::<u8>).unwrap();
        assert_ne!(x.finish(), y.finish());
    }

    #[test]
    fn version_1_is_the_first_encoding_and_matches_its_records() {
        let mut f = Fingerprinter::new("s");
        f.named("cmd", &version_b(None, None)).unwrap();
        // What an earlier release computed: arguments unnamed, structs as declared.
        let mut v1 = Vec::new();
        put_str(&mut v1, FINGERPRINT_V1);
        put_str(&mut v1, "s");
        v1.extend(canonical_bytes_v1(&version_b(None, None)).unwrap());
        assert_eq!(f.encoded_v1(), v1.as_slice());
        let fingerprints = f.finish_versions();
        use sha2::{Digest, Sha256};
        let v1 = Fingerprint(Sha256::digest(&v1).into());
        assert_eq!(fingerprints.v1(), v1);
        assert_ne!(fingerprints.current(), v1);
        assert!(fingerprints.matches(&v1));
        assert!(fingerprints.matches(&fingerprints.current()));
        assert!(!fingerprints.matches(&Fingerprint([0; 32])));
    }

    #[test]
    fn a_changed_argument_keeps_its_old_form_for_version_1() {
        let mut f = Fingerprinter::new("s");
        f.named("method", "POST").unwrap();
        f.changed("body", "canonical", "raw").unwrap();
        f.named("tail", &1_u8).unwrap();
        let mut old = Fingerprinter::new("s");
        old.arg("POST").unwrap();
        old.arg("raw").unwrap();
        old.arg(&1_u8).unwrap();
        let mut new = Fingerprinter::new("s");
        new.named("method", "POST").unwrap();
        new.named("body", "canonical").unwrap();
        new.named("tail", &1_u8).unwrap();
        assert_eq!(f.encoded_v1(), old.encoded_v1());
        let fingerprints = f.finish_versions();
        assert_eq!(fingerprints.v1(), old.finish_versions().v1());
        assert_eq!(fingerprints.current(), new.finish());
    }

    #[test]
    fn maps_keyed_by_structs_sort_by_their_new_encoding() {
        #[derive(serde::Serialize, PartialEq, Eq, PartialOrd, Ord)]
        struct K {
            z: u8,
            a: u8,
        }
        #[derive(serde::Serialize, PartialEq, Eq, PartialOrd, Ord)]
        struct KReordered {
            a: u8,
            z: u8,
        }
        let one: BTreeMap<K, u8> = [(K { z: 1, a: 2 }, 1), (K { z: 2, a: 1 }, 2)].into();
        let two: BTreeMap<KReordered, u8> = [
            (KReordered { a: 2, z: 1 }, 1),
            (KReordered { a: 1, z: 2 }, 2),
        ]
        .into();
        assert_eq!(
            canonical_bytes(&one).unwrap(),
            canonical_bytes(&two).unwrap()
        );
    }

    #[test]
    fn a_struct_is_a_map_of_its_fields() {
        #[derive(serde::Serialize)]
        struct Inner {
            b: u8,
            note: Option<String>,
        }
        #[derive(serde::Serialize)]
        struct Flattened {
            a: u8,
            #[serde(flatten)]
            inner: Inner,
        }
        #[derive(serde::Serialize)]
        struct Plain {
            b: u8,
            a: u8,
        }
        let flat = Flattened {
            a: 1,
            inner: Inner {
                b: 2,
                note: Some("n".to_owned()),
            },
        };
        let mut as_map = BTreeMap::new();
        as_map.insert("a", Some("1"));
        as_map.insert("b", None);
        // A map keeps its `None` entries: its keys are data.
        assert_ne!(
            canonical_bytes(&as_map).unwrap(),
            canonical_bytes(&BTreeMap::from([("a", Some("1"))])).unwrap()
        );
        assert_ne!(fp(&flat), fp(&Plain { b: 2, a: 1 }));
        let flat = Flattened {
            a: 1,
            inner: Inner {
                b: 2,
                note: Some("n".to_owned()),
            },
        };
        #[derive(serde::Serialize)]
        struct Whole {
            note: Option<String>,
            b: u8,
            a: u8,
        }
        let whole = Whole {
            note: Some("n".to_owned()),
            b: 2,
            a: 1,
        };
        assert_eq!(
            canonical_bytes(&flat).unwrap(),
            canonical_bytes(&whole).unwrap()
        );
    }

    proptest! {
        #[test]
        fn map_order_never_matters(entries in proptest::collection::vec((".{0,8}", any::<i64>()), 0..24)) {
            let hashed: HashMap<String, i64> = entries.iter().cloned().collect();
            let sorted: BTreeMap<String, i64> = entries.iter().cloned().collect();
            let mut reversed: Vec<(String, i64)> = sorted.clone().into_iter().collect();
            reversed.reverse();
            // A map serialised in reverse order must encode like the sorted one.
            struct Reversed(Vec<(String, i64)>);
            impl Serialize for Reversed {
                fn serialize<S: ser::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
                }
            }
            prop_assert_eq!(canonical_bytes(&hashed).unwrap(), canonical_bytes(&sorted).unwrap());
            prop_assert_eq!(canonical_bytes(&Reversed(reversed)).unwrap(), canonical_bytes(&sorted).unwrap());
        }

        #[test]
        fn equal_values_give_equal_fingerprints(order in any::<u64>(), amount in any::<i32>(), note in proptest::option::of(".{0,16}")) {
            let make = || Pay { order, amount, note: note.clone(), tags: BTreeMap::new() };
            prop_assert_eq!(fp(&make()), fp(&make()));
        }

        #[test]
        fn different_values_give_different_fingerprints(
            a in (any::<u64>(), any::<i32>(), proptest::option::of(".{0,16}")),
            b in (any::<u64>(), any::<i32>(), proptest::option::of(".{0,16}")),
        ) {
            prop_assume!(a != b);
            let pa = Pay { order: a.0, amount: a.1, note: a.2, tags: BTreeMap::new() };
            let pb = Pay { order: b.0, amount: b.1, note: b.2, tags: BTreeMap::new() };
            prop_assert_ne!(canonical_bytes(&pa).unwrap(), canonical_bytes(&pb).unwrap());
            prop_assert_ne!(fp(&pa), fp(&pb));
        }

        #[test]
        fn reordered_structs_with_added_nones_agree(order in any::<u64>(), amount in any::<i32>(), note in proptest::option::of(".{0,16}"), tags in proptest::collection::btree_map(".{0,6}", any::<f64>(), 0..5)) {
            #[derive(serde::Serialize)]
            struct Later {
                tags: BTreeMap<String, f64>,
                added: Option<Vec<u8>>,
                note: Option<String>,
                amount: i32,
                order: u64,
            }
            let earlier = Pay { order, amount, note: note.clone(), tags: tags.clone() };
            let later = Later { tags, added: None, note, amount, order };
            prop_assert_eq!(canonical_bytes(&earlier).unwrap(), canonical_bytes(&later).unwrap());
            prop_assert_eq!(fp(&earlier), fp(&later));
        }

        #[test]
        fn integer_widths_agree(v in any::<i32>()) {
            prop_assert_eq!(fp(&v), fp(&i64::from(v)));
            prop_assert_eq!(fp(&v), fp(&i128::from(v)));
        }

        #[test]
        fn streamed_hash_is_sha256_of_encoded(
            args in proptest::collection::vec(
                (
                    ".{0,90}",
                    proptest::option::of(any::<i64>()),
                    proptest::collection::hash_map(".{0,12}", proptest::collection::vec(any::<u32>(), 0..6), 0..6),
                ),
                0..12,
            ),
        ) {
            use sha2::{Digest, Sha256};
            let mut f = Fingerprinter::new("p");
            for arg in &args {
                f.arg(arg).unwrap();
            }
            let expected: [u8; 32] = Sha256::digest(f.encoded()).into();
            prop_assert_eq!(f.finish().0, expected);
        }

        #[test]
        fn key_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let parsed = crate::Key::from_bytes(&bytes);
            let valid = std::str::from_utf8(&bytes)
                .map(|s| !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control))
                .unwrap_or(false);
            prop_assert_eq!(parsed.is_ok(), valid);
        }
    }
}

#[cfg(test)]
mod golden {
    use super::*;
    use sha2::{Digest, Sha256};
    use std::collections::{BTreeMap, HashMap};

    #[derive(serde::Serialize)]
    enum Kind {
        Card { last4: String },
        Cash,
    }

    #[derive(serde::Serialize)]
    struct Order {
        id: u64,
        amount: i64,
        ratio: f64,
        note: Option<String>,
        tags: Vec<&'static str>,
        kind: Kind,
        other: Kind,
        meta: BTreeMap<String, BTreeMap<String, i32>>,
        pair: (bool, char),
        bytes: serde_bytes_like::Bytes,
    }

    mod serde_bytes_like {
        pub(super) struct Bytes(pub(super) &'static [u8]);
        impl serde::Serialize for Bytes {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
    }

    /// Records fingerprinted by earlier releases must keep matching: this value's
    /// fingerprint is fixed for `idem/fingerprint/v1`.
    #[test]
    fn the_v1_encoding_never_changes() {
        let inner = |pairs: &[(&str, i32)]| {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect::<BTreeMap<_, _>>()
        };
        let mut meta = BTreeMap::new();
        meta.insert(
            "zeta".to_owned(),
            inner(&[("b", 2), ("a", 1), ("long key", -3)]),
        );
        meta.insert("a".to_owned(), inner(&[]));
        meta.insert("mid".to_owned(), inner(&[("x", 9)]));
        let order = Order {
            id: 4_200_017,
            amount: -12_990,
            ratio: 0.25,
            note: Some("leave it with the concierge".to_owned()),
            tags: vec!["b", "a"],
            kind: Kind::Card {
                last4: "4242".to_owned(),
            },
            other: Kind::Cash,
            meta,
            pair: (true, 'é'),
            bytes: serde_bytes_like::Bytes(b"\x00\xff"),
        };
        let mut f = Fingerprinter::new("orders.pay");
        f.arg(&order).unwrap();
        f.arg("second argument").unwrap();
        let v1_bytes = Fingerprint(Sha256::digest(f.encoded_v1()).into());
        let fingerprints = f.finish_versions();
        assert_eq!(
            fingerprints.v1().to_string(),
            "f35bfc7c3d152143f387f618f48adbb71138af072625b5405a49c9aa79c35ece"
        );
        assert_eq!(fingerprints.v1(), v1_bytes);
        assert_eq!(
            fingerprints.current().to_string(),
            "2d8eb9b31d56609865fd21a86247c4882c00940aebfc01dbccc45d517bf8a3dc"
        );
    }

    #[derive(serde::Serialize)]
    enum Shape {
        Unit,
        Newtype(Option<u8>),
        Tuple(i8, String),
        Fields {
            long: String,
            nested: HashMap<String, Vec<Option<Shape>>>,
        },
    }

    /// Values that exercise every path of the encoder (maps nested in maps and sequences,
    /// unsorted `HashMap`s, every kind of enum variant, options, strings far longer than any
    /// buffer, byte strings) keep the fingerprint `idem/fingerprint/v1` gave them.
    #[test]
    fn rich_values_keep_their_v1_fingerprint() {
        let long = "0123456789abcdef".repeat(700);
        let mut inner = HashMap::new();
        for i in 0..40_u8 {
            let shapes = (0..i % 4)
                .map(|j| match j {
                    0 => Some(Shape::Unit),
                    1 => Some(Shape::Newtype(Some(i))),
                    2 => Some(Shape::Tuple(
                        -(i as i8),
                        format!("t{i}").repeat(usize::from(i)),
                    )),
                    _ => None,
                })
                .collect();
            inner.insert(
                format!("key {i:03} {}", "x".repeat(usize::from(i) * 3)),
                shapes,
            );
        }
        let mut outer: HashMap<String, HashMap<String, Vec<Option<Shape>>>> = HashMap::new();
        outer.insert("b".to_owned(), HashMap::new());
        outer.insert("a".to_owned(), inner);
        let value = (
            Shape::Fields {
                long: long.clone(),
                nested: HashMap::new(),
            },
            outer,
            vec![Some(1.5_f32), None],
            serde_bytes_like::Bytes(&[7; 300]),
            long,
        );
        let mut f = Fingerprinter::new("rich");
        f.arg(&value).unwrap();
        f.arg(&Shape::Unit).unwrap();
        let from_bytes = Fingerprint(Sha256::digest(f.encoded()).into());
        let fingerprints = f.clone().finish_versions();
        assert_eq!(fingerprints.current(), from_bytes);
        assert_eq!(f.finish(), from_bytes);
        assert_eq!(
            fingerprints.v1().to_string(),
            "2618e7d052080e3924544b96388b40da7ef47a85bf452bf411f343f2db8e91a2"
        );
        assert_eq!(
            fingerprints.current().to_string(),
            "a4b01d7924bf5baad04f8b92c497987e6aa849e55f985aaceb929c7b864c3d78"
        );
    }

    /// Version 2's bytes, written out by hand: the tag, the scope, each named argument in
    /// order of name (one that is `None` left out), a struct as a map sorted by encoded
    /// field name (shorter names first) without its `None` and unit fields.
    #[test]
    fn the_v2_encoding_is_as_specified() {
        #[derive(serde::Serialize)]
        struct Cmd {
            zz: u8,
            a: Option<u8>,
            unit: (),
            b: Option<Option<bool>>,
        }
        let mut f = Fingerprinter::new("s");
        f.named(
            "cmd",
            &Cmd {
                zz: 7,
                a: None,
                unit: (),
                b: Some(None),
            },
        )
        .unwrap();
        f.named("absent", &None::<u8>).unwrap();
        f.named("added", &Some(1_u8)).unwrap();
        let s = |text: &str| {
            let mut out = vec![tag::STR];
            out.extend_from_slice(&(text.len() as u64).to_be_bytes());
            out.extend_from_slice(text.as_bytes());
            out
        };
        let int = |v: u8| {
            let mut out = vec![tag::INT, 0];
            out.extend_from_slice(&u128::from(v).to_be_bytes());
            out
        };
        let expected = [
            s("idem/fingerprint/v2"),
            s("s"),
            s("added"),
            vec![tag::SOME],
            int(1),
            s("cmd"),
            vec![tag::MAP],
            s("b"),
            vec![tag::SOME, tag::UNIT],
            s("zz"),
            int(7),
            vec![tag::END],
        ]
        .concat();
        assert_eq!(f.encoded(), expected);
        assert_eq!(f.finish(), Fingerprint(Sha256::digest(&expected).into()));
    }
}
