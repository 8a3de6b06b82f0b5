//! The start of a record id, as an operator copies it from a log line or from `idem leases`:
//! the range of ids it covers.

/// The start of a record id, as an operator copies it from a log line (`key_hash`, 16 hex
/// digits) or from `idem leases` (64): 1 to 64 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdPrefix {
    /// The lowest id the prefix covers (the prefix, then zeros).
    pub(super) low: [u8; 32],
    /// The highest id it covers (the prefix, then ones).
    pub(super) high: [u8; 32],
    /// The digits, lowercase.
    digits: String,
}

impl std::fmt::Display for IdPrefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.digits)
    }
}

impl IdPrefix {
    /// Parses 1 to 64 hex digits (either case; surrounding blanks ignored).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() || text.len() > 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "a record id is 1 to 64 hex digits (the `key_hash` of a log line, or the id \
                `idem leases` prints), not `{text}`"
            ));
        }
        let (mut low, mut high) = ([0u8; 32], [0xffu8; 32]);
        for (i, digit) in text.bytes().enumerate() {
            // Checked above: every byte is a hex digit.
            let nibble = (digit as char).to_digit(16).unwrap_or(0) as u8;
            let (byte, shift) = (i / 2, if i % 2 == 0 { 4 } else { 0 });
            low[byte] = (low[byte] & !(0xf << shift)) | (nibble << shift);
            high[byte] = (high[byte] & !(0xf << shift)) | (nibble << shift);
        }
        Ok(Self {
            low,
            high,
            digits: text.to_ascii_lowercase(),
        })
    }

    /// The whole id, when the prefix has all 64 digits.
    pub fn whole(&self) -> Option<[u8; 32]> {
        (self.digits.len() == 64).then_some(self.low)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_covers_the_ids_that_start_with_it() {
        let odd = IdPrefix::parse("7Fa").expect("three digits");
        assert_eq!(&odd.low[..3], &[0x7f, 0xa0, 0]);
        assert_eq!(&odd.high[..3], &[0x7f, 0xaf, 0xff]);
        assert_eq!(odd.whole(), None);
        let whole = "ab".repeat(32);
        assert_eq!(
            IdPrefix::parse(&whole).expect("64").whole(),
            Some([0xab; 32])
        );
        for bad in ["", "xyz", &"a".repeat(65), "12 34"] {
            let refused = IdPrefix::parse(bad).expect_err(bad);
            assert!(refused.contains("1 to 64 hex digits"), "{refused}");
        }
    }
}
