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
    fn encoded_keys_order_as_their_bytes(
        prefix in proptest::collection::vec(any::<u8>(), 0..12),
        a in proptest::collection::vec(any::<u8>(), 0..12),
        b in proptest::collection::vec(any::<u8>(), 0..12),
    ) {
        let (a, b) = ([prefix.as_slice(), &a].concat(), [prefix.as_slice(), &b].concat());
        prop_assert_eq!(super::upgrade::encoded_order(&a, &b), a.cmp(&b));
    }

    #[test]
    fn an_argument_encodes_as_its_canonical_bytes(
        items in proptest::collection::vec(
            (
                ".{0,12}",
                proptest::option::of(any::<i64>()),
                proptest::collection::btree_map(".{0,6}", proptest::collection::vec(any::<u16>(), 0..3), 0..4),
            ),
            0..6,
        ),
        n in any::<u8>(),
    ) {
        #[derive(serde::Serialize)]
        struct Item { zeta: String, alpha: Option<i64>, mid: BTreeMap<String, Vec<u16>> }
        #[derive(serde::Serialize)]
        struct Outer { items: Vec<Item>, first: Option<Item>, n: u8 }
        let item = |(zeta, alpha, mid): &(String, Option<i64>, BTreeMap<String, Vec<u16>>)| Item {
            zeta: zeta.clone(), alpha: *alpha, mid: mid.clone(),
        };
        let outer = Outer { first: items.first().map(item), items: items.iter().map(item).collect(), n };
        let mut f = Fingerprinter::new("s");
        f.named("cmd", &outer).unwrap();
        // The argument, written from its known end, as the value written alone.
        prop_assert!(f.encoded().ends_with(&canonical_bytes(&outer).unwrap()));
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
