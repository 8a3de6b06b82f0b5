//! What a key may be: its length limit and the ways a key is refused. A leaf: the error type
//! quotes these problems and the key's constructors produce them, so both build on this file
//! rather than on each other.

/// Longest accepted key, in bytes (Stripe's limit; fits an indexed `VARCHAR(255)`).
pub const MAX_KEY_LEN: usize = 255;

/// Why a key was refused. Part of [`Error::InvalidKey`](crate::Error::InvalidKey).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    TooLong {
        /// Length of the refused key in bytes.
        len: usize,
    },
    /// The key contains a control character.
    ControlCharacter {
        /// Byte offset of the first control character.
        at: usize,
    },
    /// The key bytes are not UTF-8.
    NotUtf8,
    /// The request carries the key header more than once (a repeated field is not one
    /// structured-field string, so no value of it can be trusted).
    Repeated {
        /// How many fields were sent.
        count: usize,
    },
}

impl std::fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Empty => f.write_str("the key is empty"),
            Self::TooLong { len } => write!(
                f,
                "the key is {len} bytes long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::ControlCharacter { at } => {
                write!(f, "the key contains a control character at byte {at}")
            }
            Self::NotUtf8 => f.write_str("the key is not valid UTF-8"),
            Self::Repeated { count } => write!(
                f,
                "the Idempotency-Key header was sent {count} times; send it once"
            ),
        }
    }
}

/// Why `key` is not a valid key, or `None` when it is one.
pub(crate) fn refusal(key: &str) -> Option<KeyProblem> {
    if key.is_empty() {
        Some(KeyProblem::Empty)
    } else if key.len() > MAX_KEY_LEN {
        Some(KeyProblem::TooLong { len: key.len() })
    } else {
        key.char_indices()
            .find(|(_, c)| c.is_control())
            .map(|(at, _)| KeyProblem::ControlCharacter { at })
    }
}
