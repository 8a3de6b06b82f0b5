//! What can go wrong under a statement, as the store sees it: the driver's error, or one of
//! idem's own (a row that does not decode, a row that should exist and does not). A driver
//! only classifies its errors; idem's faults are not dressed as driver errors.

use std::fmt;

use idem_core::Error;

use crate::{Decode, Failure};

/// A statement's failure: the driver's error, or idem's own finding about its answer.
#[derive(Debug)]
pub enum Fault<E> {
    /// The driver's error.
    Db(E),
    /// A row did not hold what its statement declares.
    Decode(Decode),
    /// A row the statement should have found was not there (named).
    Missing(&'static str),
    /// A stored value idem could not read (an outbox message's headers), described.
    Undecodable(String),
    /// The group commit that held this write failed or ended without answering it (SQLite's
    /// lease writes, `write_grouped`): the write did not happen, and may be sent again.
    Group(String),
}

impl<E> From<Decode> for Fault<E> {
    fn from(decode: Decode) -> Self {
        Fault::Decode(decode)
    }
}

impl<E> Fault<E> {
    /// What kind of failure this is, the driver's error classified by `classify`: idem's own
    /// findings are [`Failure::Other`].
    pub fn failure(&self, classify: impl FnOnce(&E) -> Failure) -> Failure {
        match self {
            Fault::Db(e) => classify(e),
            Fault::Group(_) => Failure::Unavailable,
            _ => Failure::Other,
        }
    }
}

impl<E: std::error::Error + Send + Sync + 'static> Fault<E> {
    /// idem's error for this fault, met while `doing` something: the driver's error as
    /// `classify` says ([`Failure::error`], naming `create_tables` for a missing ledger), or
    /// a store error saying what idem found.
    pub fn into_error(
        self,
        doing: &str,
        classify: impl FnOnce(&E) -> Failure,
        create_tables: &str,
    ) -> Error {
        match self {
            Fault::Db(e) => classify(&e).error(doing, e, create_tables),
            Fault::Decode(decode) => Error::store(format!("unreadable row while {doing}"), decode),
            Fault::Missing(what) => Error::Store {
                message: format!("{what} was not found while {doing}"),
                source: None,
            },
            Fault::Undecodable(what) => Error::Store {
                message: format!("{what} (while {doing})"),
                source: None,
            },
            // Nothing was written: as a lost connection, the call may be sent again.
            Fault::Group(why) => Error::Unavailable {
                message: format!("{why} while {doing}"),
                retry_after: std::time::Duration::from_secs(1),
            },
        }
    }
}

impl<E: fmt::Display> fmt::Display for Fault<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::Db(e) => e.fmt(f),
            Fault::Decode(decode) => decode.fmt(f),
            Fault::Missing(what) => write!(f, "{what} was not found"),
            Fault::Undecodable(what) | Fault::Group(what) => f.write_str(what),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Fault<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Fault::Db(e) => Some(e),
            Fault::Decode(decode) => Some(decode),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Fault;
    use crate::{Decode, Failure};

    #[derive(Debug)]
    struct Lost;

    impl std::fmt::Display for Lost {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connection lost")
        }
    }

    impl std::error::Error for Lost {}

    #[test]
    fn the_driver_classifies_its_errors_and_idem_s_findings_are_store_errors() {
        let lost = Fault::Db(Lost);
        assert_eq!(lost.failure(|_| Failure::Unavailable), Failure::Unavailable);
        let error = lost.into_error("claiming the key", |_| Failure::Unavailable, "");
        assert!(
            matches!(error, idem_core::Error::Unavailable { .. }),
            "{error:?}"
        );

        let decode = Fault::<Lost>::from(Decode {
            column: 2,
            expected: "an integer",
            found: "text",
        });
        assert_eq!(decode.failure(|_| Failure::Unavailable), Failure::Other);
        let error = decode.into_error("reading the key", |_| Failure::Unavailable, "");
        assert!(error.to_string().contains("reading the key"), "{error}");

        // A write whose group commit failed did not happen: the call may be sent again.
        let group = Fault::<Lost>::Group("the group commit failed: disk I/O error".to_owned());
        assert_eq!(group.failure(|_| Failure::Other), Failure::Unavailable);
        let error = group.into_error("claiming a lease", |_| Failure::Other, "");
        assert!(
            matches!(error, idem_core::Error::Unavailable { .. }),
            "{error:?}"
        );

        let missing = Fault::<Lost>::Missing("the claimed ledger row");
        let error = missing.into_error("reading the claimed key", |_| Failure::Other, "");
        assert!(
            error
                .to_string()
                .contains("the claimed ledger row was not found"),
            "{error}"
        );
    }
}
