//! The canonical encoding: a serde `Serializer` writing the tagged, self-delimiting form
//! (version 1's), with map entries sorted by their encoded key.

use serde::ser::{self, Serialize};

use super::FingerprintError;
use super::blocks::Sink;

/// The byte before each value of the canonical encoding. Frozen: a change is a new
/// `FINGERPRINT_VERSION`.
pub(super) mod tag {
    macro_rules! tags {
        ($($name:ident = $byte:literal),+) => { $(pub(crate) const $name: u8 = $byte;)+ };
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
pub(super) fn put_header(out: &mut impl Sink, tag: u8, len: usize) {
    let mut header = [tag; 9];
    header[1..].copy_from_slice(&(len as u64).to_be_bytes());
    out.put(&header);
}

#[inline]
pub(super) fn put_str(out: &mut impl Sink, s: &str) {
    put_header(out, tag::STR, s.len());
    out.put(s.as_bytes());
}

pub(super) fn put_int(out: &mut impl Sink, negative: bool, magnitude: u128) {
    let mut token = [tag::INT; 18];
    token[1] = u8::from(negative && magnitude != 0);
    token[2..].copy_from_slice(&magnitude.to_be_bytes());
    out.put(&token);
}

pub(super) fn put_signed(out: &mut impl Sink, v: i128) {
    put_int(out, v < 0, v.unsigned_abs());
}

pub(super) fn put_unsigned(out: &mut impl Sink, v: u128) {
    put_int(out, false, v);
}

pub(super) fn put_float(out: &mut impl Sink, v: f64) {
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
pub(super) struct Canonical<'a, S> {
    pub(super) out: &'a mut S,
}

/// Writes a map's entries to a scratch buffer of its own as they come, then to `out` in the
/// canonical order (by encoded key) when the map ends.
pub(super) struct MapEncoder<'a, S> {
    pub(super) out: &'a mut S,
    pub(super) scratch: MapScratch,
}

/// A map's entries before they are sorted.
#[derive(Default)]
pub(super) struct MapScratch {
    pub(super) bytes: Vec<u8>,
    /// Each entry as offsets in `bytes`: key start, key end (its value's start), value end.
    pub(super) entries: Vec<(usize, usize, usize)>,
}

thread_local! {
    /// Scratch buffers of finished maps, reused by the next: growing fresh ones for every
    /// map would cost as much as encoding it. One per level of nesting.
    static MAP_SCRATCH: std::cell::RefCell<Vec<MapScratch>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Scratch buffers larger than this are freed rather than kept for the next map.
pub(super) const MAP_SCRATCH_LIMIT: usize = 64 * 1024;
/// Levels of map nesting whose scratch buffers are kept.
pub(super) const MAP_SCRATCH_DEPTH: usize = 8;

impl MapScratch {
    /// An empty scratch buffer, reused if this thread has one.
    pub(super) fn take() -> Self {
        MAP_SCRATCH
            .try_with(|pool| pool.try_borrow_mut().ok()?.pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Keeps this buffer for the next map on this thread, unless it is too large to keep.
    pub(super) fn give_back(mut self) {
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
    pub(super) fn variant(&mut self, variant: &str, value_tag: u8) -> &mut Self {
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
    pub(super) fn element<T: Serialize + ?Sized>(
        &mut self,
        value: &T,
    ) -> Result<(), FingerprintError> {
        value.serialize(&mut *self)?;
        self.out.checkpoint();
        Ok(())
    }
    pub(super) fn field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), FingerprintError> {
        put_str(self.out, key);
        value.serialize(&mut *self)?;
        self.out.checkpoint();
        Ok(())
    }
    pub(super) fn end(&mut self) -> Result<(), FingerprintError> {
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
        entries.sort_unstable_by(|a, b| super::upgrade::encoded_order(key(a), key(b)));
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
