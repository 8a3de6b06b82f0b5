//! What a fingerprint costs next to the SHA-256 it cannot avoid (issue 23, P5), without the
//! benchmark's database: the 1 KiB `PayOrder` of `tools/bench` (same fields, same serde
//! types, same values), timed three ways, taking turns round by round (ABC, CBA, …):
//! the whole fingerprint, the canonical encoding alone, and `sha2`'s SHA-256 of the same
//! canonical bytes. Prints the medians and the ratio whole / SHA-256 (goal ≤ 1.3).
//! (The fingerprint hashes its bytes a block at a time as they are encoded, so "encoding
//! alone" — `new` and `arg` without `finish` — includes hashing all but the last blocks.)
//!
//! ```sh
//! cargo run --release -p idem-core --example fingerprint_cost [rounds] [iterations]
//! ```

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use idem_core::Fingerprinter;
use serde::Serialize;
use sha2::{Digest, Sha256};

#[derive(Debug, Clone, Serialize)]
struct PayOrder {
    idempotency_key: String,
    order_id: i64,
    customer_id: i64,
    amount_cents: i64,
    currency: String,
    payment_method: PaymentMethod,
    billing_address: Address,
    items: Vec<LineItem>,
    customer_note: String,
    metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
struct PaymentMethod {
    kind: String,
    card_token: String,
    brand: String,
    last4: String,
    exp_month: u8,
    exp_year: u16,
    holder_name: String,
}

#[derive(Debug, Clone, Serialize)]
struct Address {
    name: String,
    line1: String,
    line2: String,
    city: String,
    region: String,
    postcode: String,
    country: String,
}

#[derive(Debug, Clone, Serialize)]
struct LineItem {
    sku: String,
    description: String,
    quantity: u32,
    unit_price_cents: i64,
}

/// The benchmark's request (`tools/bench/src/workload.rs`, `template`), padded to 1 KiB of JSON.
fn pay_order() -> PayOrder {
    let item = |sku: &str, description: &str, quantity: u32, unit_price_cents: i64| LineItem {
        sku: sku.into(),
        description: description.into(),
        quantity,
        unit_price_cents,
    };
    let metadata = [
        ("channel", "web"),
        ("client_ip", "203.0.113.42"),
        ("session", "s_7Hq2LrX9vK3mPz8YwT4n"),
        (
            "user_agent",
            "Mozilla/5.0 (X11; Linux x86_64) Chrome/131.0 Safari/537.36",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let mut cmd = PayOrder {
        idempotency_key: "0192f3a4-7b1c-7d2e-8f40-5a6b7c8d9e0f".into(),
        order_id: 16_001,
        customer_id: 4_200_017,
        amount_cents: 12_990,
        currency: "EUR".into(),
        payment_method: PaymentMethod {
            kind: "card".into(),
            card_token: "tok_1QbGx2Lk8sZr4PqW9mYtVn3Hc7Jd5Fa0Ee6Rb1Ux".into(),
            brand: "visa".into(),
            last4: "4242".into(),
            exp_month: 9,
            exp_year: 2029,
            holder_name: "Ada Lovelace".into(),
        },
        billing_address: Address {
            name: "Ada Lovelace".into(),
            line1: "12 Analytical Engine Street".into(),
            line2: "Flat 3".into(),
            city: "London".into(),
            region: "Greater London".into(),
            postcode: "NW1 6XE".into(),
            country: "GB".into(),
        },
        items: vec![
            item("SKU-10442", "Mechanical keyboard, brown switches", 1, 8_990),
            item("SKU-20871", "USB-C cable, braided, 2 m", 2, 1_250),
            item("SKU-31007", "Desk mat, felt, dark grey", 1, 1_500),
        ],
        customer_note: "Leave it with the concierge. ".into(),
        metadata,
    };
    let len = serde_json::to_vec(&cmd).map_or(1024, |v| v.len());
    cmd.customer_note
        .extend(std::iter::repeat_n('.', 1024_usize.saturating_sub(len)));
    cmd
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Debug, Clone, Copy)]
enum Part {
    Whole,
    Encoding,
    Sha256,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let rounds = args.next().transpose()?.unwrap_or(201);
    let iters = args.next().transpose()?.unwrap_or(2_000);
    let cmd = pay_order();
    let mut canonical = Fingerprinter::new("bench.pay");
    canonical.named("cmd", &cmd)?;
    let bytes = canonical.encoded().to_vec();
    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    let parts = [Part::Whole, Part::Encoding, Part::Sha256];
    for round in 0..rounds {
        for i in 0..parts.len() {
            let slot = if round % 2 == 0 {
                i
            } else {
                parts.len() - 1 - i
            };
            let start = Instant::now();
            for _ in 0..iters {
                match parts[slot] {
                    Part::Whole => {
                        let mut f = Fingerprinter::new(black_box("bench.pay"));
                        f.named("cmd", black_box(&cmd))?;
                        black_box(f.finish_versions());
                    }
                    Part::Encoding => {
                        let mut e = Fingerprinter::new(black_box("bench.pay"));
                        e.named("cmd", black_box(&cmd))?;
                        black_box(e.encoded_v1().len());
                    }
                    Part::Sha256 => {
                        black_box(Sha256::digest(black_box(bytes.as_slice())));
                    }
                }
            }
            samples[slot].push(start.elapsed().as_secs_f64() * 1e6 / iters as f64);
        }
    }
    let [whole, encoding, sha256] = samples.map(|mut s| median(&mut s));
    println!(
        "{} canonical bytes; µs per call, median of {rounds} rounds of {iters}:",
        bytes.len()
    );
    println!("  whole fingerprint  {whole:.3}");
    println!("  encoding alone     {encoding:.3}");
    println!("  SHA-256 of bytes   {sha256:.3}");
    println!("  whole / SHA-256    {:.3}", whole / sha256);
    Ok(())
}
