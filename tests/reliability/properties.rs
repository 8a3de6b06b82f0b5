//! R8 properties (proptest): fingerprints are canonical and discriminating, ledger ids
//! separate (scope, principal, key), key parsing never panics.
//!
//! No database store: these are properties of the fingerprint, the key and the ledger id,
//! on the in-memory store, the same whichever store persists them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};

use idem::{ErrorKind, Outcome, idempotent, with_outcome};
use proptest::prelude::*;
use serde::Serialize;

use crate::support::quick;

fn fingerprint<T: Serialize + ?Sized>(scope: &str, args: &[&T]) -> (Vec<u8>, idem::Fingerprint) {
    let mut f = idem::Fingerprinter::new(scope);
    for a in args {
        f.arg(a).expect("serialisable");
    }
    (f.encoded().to_vec(), f.finish())
}

/// A map serialised in exactly the given entry order.
struct InOrder(Vec<(String, i64)>);

impl Serialize for InOrder {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct Order {
    id: u64,
    customer: String,
    lines: Vec<(String, u32)>,
    note: Option<String>,
    discount: Option<i16>,
    attributes: BTreeMap<String, String>,
}

fn order() -> impl Strategy<Value = Order> {
    (
        any::<u64>(),
        ".{0,12}",
        proptest::collection::vec((".{0,6}", any::<u32>()), 0..5),
        proptest::option::of(".{0,8}"),
        proptest::option::of(any::<i16>()),
        proptest::collection::btree_map(".{0,6}", ".{0,6}", 0..4),
    )
        .prop_map(|(id, customer, lines, note, discount, attributes)| Order {
            id,
            customer,
            lines,
            note,
            discount,
            attributes,
        })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

#[idempotent(scope = "rel.prop", key = key, skip(runs))]
async fn tagged(
    store: &idem::MemoryStore,
    key: String,
    tags: HashMap<String, i64>,
    runs: &AtomicUsize,
) -> Result<usize, idem::Error> {
    let _ = (store, tags);
    Ok(runs.fetch_add(1, Ordering::SeqCst))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if quick() { 256 } else { 1_000 },
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Canonical: equal values give equal bytes, whatever their map order.
    #[test]
    fn equal_values_give_equal_bytes(o in order(), entries in proptest::collection::vec((".{0,8}", any::<i64>()), 0..16)) {
        // An equal value built separately (its maps and strings are fresh allocations).
        let twin = Order {
            attributes: o.attributes.iter().rev().map(|(k, v)| (k.clone(), v.clone())).collect(),
            ..o.clone()
        };
        let (a, fa) = fingerprint("orders.pay", &[&o]);
        let (b, fb) = fingerprint("orders.pay", &[&twin]);
        prop_assert_eq!(&o, &twin);
        prop_assert_eq!(a, b);
        prop_assert_eq!(fa, fb);

        let sorted: BTreeMap<String, i64> = entries.iter().cloned().collect();
        let hashed: HashMap<String, i64> = entries.iter().cloned().collect();
        let mut reversed: Vec<(String, i64)> = sorted.clone().into_iter().collect();
        reversed.reverse();
        let canonical = fingerprint("s", &[&sorted]).0;
        prop_assert_eq!(&fingerprint("s", &[&hashed]).0, &canonical);
        prop_assert_eq!(&fingerprint("s", &[&InOrder(reversed)]).0, &canonical);
    }

    /// Canonical across number widths: `v` as u32, u64, i64 and i128 is one value.
    #[test]
    fn integer_widths_and_float_widths_agree(v in any::<u32>(), x in any::<f32>()) {
        let u = fingerprint("s", &[&v]).1;
        prop_assert_eq!(u, fingerprint("s", &[&u64::from(v)]).1);
        prop_assert_eq!(u, fingerprint("s", &[&i64::from(v)]).1);
        prop_assert_eq!(u, fingerprint("s", &[&i128::from(v)]).1);
        prop_assert_eq!(fingerprint("s", &[&x]).1, fingerprint("s", &[&f64::from(x)]).1);
    }

    /// Discriminating: different values, scopes or argument splits never collide.
    #[test]
    fn different_values_give_different_fingerprints(a in order(), b in order(), s in ".{0,8}", t in ".{0,8}") {
        prop_assume!(a != b);
        prop_assert_ne!(fingerprint("orders.pay", &[&a]).1, fingerprint("orders.pay", &[&b]).1);
        if s != t {
            prop_assert_ne!(fingerprint(&s, &[&a]).1, fingerprint(&t, &[&a]).1);
        }
        // Moving a character from one argument to the next changes the fingerprint.
        let joined = format!("{s}{t}");
        if let Some(c) = joined.chars().next() {
            let (head, tail) = joined.split_at(c.len_utf8());
            if head != s.as_str() {
                prop_assert_ne!(fingerprint("x", &[head, tail]).1, fingerprint("x", &[s.as_str(), t.as_str()]).1);
            }
        }
    }

    /// Key parsing never panics on arbitrary bytes, and accepts exactly 1..=255 bytes of
    /// UTF-8 without control characters.
    #[test]
    fn key_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), text in "\\PC{0,40}|.{0,300}") {
        let valid = |s: &str| !s.is_empty() && s.len() <= idem::MAX_KEY_LEN && !s.chars().any(char::is_control);
        let parsed = idem::Key::from_bytes(&bytes);
        let expected = std::str::from_utf8(&bytes).is_ok_and(valid);
        prop_assert_eq!(parsed.is_ok(), expected);
        if let Err(e) = parsed {
            prop_assert_eq!(e.kind(), ErrorKind::InvalidKey);
        }
        let from_source = idem::KeySource::to_key(&bytes);
        prop_assert_eq!(from_source.is_ok(), expected);
        let parsed = idem::Key::new(text.as_str());
        prop_assert_eq!(parsed.is_ok(), valid(&text));
        if let Ok(k) = parsed {
            prop_assert_eq!(k.as_str(), text.as_str());
        }
    }

    /// The ledger id discriminates (scope, principal, key) triples: changing any one
    /// part, or moving a boundary between two parts, gives another id.
    #[test]
    fn record_ids_discriminate(
        base in (".{0,6}", ".{0,6}", ".{0,6}"),
        other in ".{0,6}",
        part in 0..3_usize,
        b in (".{0,6}", ".{0,6}", ".{0,6}"),
    ) {
        let id = |t: &(String, String, String)| idem::store::record_id(&t.0, &t.1, &t.2);
        let mut changed = base.clone();
        match part {
            0 => changed.0 = other,
            1 => changed.1 = other,
            _ => changed.2 = other,
        }
        if changed != base {
            prop_assert_ne!(id(&changed), id(&base));
        }
        // Move the first character of the key into the principal, and of the principal
        // into the scope.
        for (from, to) in [(2, 1), (1, 0)] {
            let mut parts = [base.0.clone(), base.1.clone(), base.2.clone()];
            if let Some(c) = parts[from].chars().next() {
                parts[from].remove(0);
                parts[to].push(c);
                let shifted = (parts[0].clone(), parts[1].clone(), parts[2].clone());
                prop_assert_ne!(id(&shifted), id(&base));
            }
        }
        if b != base {
            prop_assert_ne!(id(&b), id(&base));
        }
    }

    /// Through `#[idempotent]`: the same map in another order replays; another map is
    /// `KeyReused`.
    #[test]
    fn the_handler_sees_map_order_as_irrelevant(entries in proptest::collection::btree_map("[a-z]{1,6}", any::<i64>(), 1..12), extra in "[A-Z]{1,4}") {
        runtime().block_on(async {
            let store = idem::MemoryStore::new();
            let runs = AtomicUsize::new(0);
            let forward: HashMap<String, i64> = entries.clone().into_iter().collect();
            let mut backward = HashMap::new();
            for (k, v) in entries.iter().rev() {
                backward.insert(k.clone(), *v);
            }
            let first = tagged(&store, "k".into(), forward, &runs).await.expect("first");
            let (again, outcome) = with_outcome(tagged(&store, "k".into(), backward, &runs)).await;
            prop_assert_eq!(again.expect("replay"), first);
            prop_assert_eq!(outcome, Some(Outcome::Replayed));
            let mut other: HashMap<String, i64> = entries.clone().into_iter().collect();
            other.insert(extra, 0);
            let reused = tagged(&store, "k".into(), other, &runs).await;
            prop_assert_eq!(reused.map_err(|e| e.kind()), Err(ErrorKind::KeyReused));
            prop_assert_eq!(runs.load(Ordering::SeqCst), 1);
            Ok(())
        })?;
    }
}
