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

mod blocks;
mod canonical;
#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
mod upgrade;

use blocks::{Buffer, Sink, SpareBytes};
use canonical::put_str;
use canonical::{Canonical, tag};
use upgrade::Upgrade;

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
            // Its end is known: written without a walk to find it (and whether it is plain).
            upgrade.known(start, end, false);
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
