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
