//! Version 2 derived from version 1's bytes: struct fields sorted by name, default fields
//! left out, without encoding the arguments a second time.

use super::blocks::Sink;
use super::canonical::tag;

/// One entry of a map or struct being upgraded: offsets in version 1's bytes of its key, its
/// value and its end, and whether each reads the same in both versions.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) key: usize,
    pub(super) value: usize,
    pub(super) end: usize,
    pub(super) plain_key: bool,
    pub(super) plain_value: bool,
}

thread_local! {
    /// The entry stack of this thread's last upgrade, reused by the next.
    static SPARE_ENTRIES: std::cell::Cell<Vec<Entry>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Derives version 2's encoding of values from version 1's bytes (the module docs say what
/// changes): structs become maps sorted by field name, without their `None` and unit fields;
/// everything else is copied as it is. A value that holds no struct ("plain") reads the same
/// in both versions and is copied in one piece.
///
/// It reads only bytes [`Canonical`] wrote; bytes it cannot read (a truncated token, an
/// unknown tag) are copied as they are rather than panicking: the result is still a pure
/// function of the input.
pub(super) struct Upgrade<'a, S> {
    pub(super) bytes: &'a [u8],
    pub(super) out: &'a mut S,
    /// The entries of every map and struct open on the way down, a level's above its
    /// parent's.
    pub(super) entries: Vec<Entry>,
}

impl<'a, S: Sink> Upgrade<'a, S> {
    pub(super) fn new(bytes: &'a [u8], out: &'a mut S) -> Self {
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
    pub(super) fn give_back(mut self) {
        self.entries.clear();
        let entries = std::mem::take(&mut self.entries);
        let _ = SPARE_ENTRIES.try_with(|spare| spare.set(entries));
    }

    pub(super) fn byte(&self, at: usize) -> Option<u8> {
        self.bytes.get(at).copied()
    }

    pub(super) fn copy(&mut self, from: usize, to: usize) {
        self.out.put(
            self.bytes
                .get(from..to.min(self.bytes.len()))
                .unwrap_or_default(),
        );
    }

    /// Where the value at `at` ends, and whether it is plain.
    pub(super) fn skip(&self, at: usize) -> (usize, bool) {
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
            // A map whose keys and values hold no struct reads the same in both versions
            // (its entries keep version 1's order, by encoded key): plain, copied in one
            // piece. A struct never is.
            Some(tag::MAP | tag::STRUCT) => {
                let (mut next, mut plain) = (at + 1, self.byte(at) == Some(tag::MAP));
                while next < end && self.byte(next) != Some(tag::END) {
                    let (key_end, key_plain) = self.skip(next);
                    let (value_end, value_plain) = self.skip(key_end);
                    (next, plain) = (value_end, plain && key_plain && value_plain);
                }
                ((next + 1).min(end), plain)
            }
            _ => (end, true),
        }
    }

    /// Writes the value at `at`; returns where it ends.
    pub(super) fn value(&mut self, at: usize) -> usize {
        if self.byte(at) == Some(tag::STRUCT) {
            // Never plain, and its entries find its end: no walk ahead of them.
            return self.entries(at, self.bytes.len(), true);
        }
        let (end, plain) = self.skip(at);
        self.known(at, end, plain);
        end
    }

    /// Writes the value at `at`, which ends at `end`. `plain` may be `false` for a value
    /// that is plain (not known to be): it is then written piece by piece, the same bytes.
    pub(super) fn known(&mut self, at: usize, end: usize, plain: bool) {
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
            Some(tag::MAP) => drop(self.entries(at, end, false)),
            Some(tag::STRUCT) => drop(self.entries(at, end, true)),
            _ => self.copy(at, end),
        }
    }

    /// The encoded key of an entry (a struct's field name as a string).
    pub(super) fn key(&self, entry: &Entry) -> &'a [u8] {
        self.bytes.get(entry.key..entry.value).unwrap_or_default()
    }

    /// Writes the map or struct at `at` (which ends by `end`) as a map: a struct's fields
    /// sorted like a map's keys and those that are `None` or unit left out. Returns where it
    /// ends.
    pub(super) fn entries(&mut self, at: usize, end: usize, is_struct: bool) -> usize {
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
                sorted &= encoded_order(self.key(last), self.key(&entry)).is_le();
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
                level.sort_by(|a, b| encoded_order(key(a), key(b)));
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
        (next + 1).min(self.bytes.len())
    }

    /// Sorts the entries from `base` by their keys' version 2 encoding (a map keyed by
    /// structs or maps: rare, so the keys are encoded twice).
    pub(super) fn sort_by_upgraded_keys(&mut self, base: usize) {
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

/// The order of two encoded keys, as their bytes compare. A field name's encoding starts with
/// its tag and its length as 8 big-endian bytes, so two names of different lengths compare as
/// those 9 bytes do: one integer comparison where a byte-wise one would be a call to `memcmp`
/// (a struct's fields are sorted on every fingerprint: P5).
#[inline]
pub(super) fn encoded_order(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    let header = |key: &[u8]| key.first_chunk::<9>().map(|h| u128::from_be_bytes(pad(*h)));
    match (header(a), header(b)) {
        (Some(x), Some(y)) if x != y => x.cmp(&y),
        _ => a.cmp(b),
    }
}

/// A 9-byte header as the high bytes of a `u128`, so that integers compare as the bytes do.
#[inline]
fn pad(header: [u8; 9]) -> [u8; 16] {
    let mut wide = [0_u8; 16];
    if let Some(high) = wide.first_chunk_mut::<9>() {
        *high = header;
    }
    wide
}
