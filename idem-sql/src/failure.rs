//! What a database error means for a claim, from the codes the servers give it: the same for
//! every store, whichever driver carried the error.

use idem_core::Error;

/// What kind of failure a database error is, as far as the ledger cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The ledger table does not exist.
    MissingTable,
    /// No connection: the pool could not get one in time, or the server went away or ended
    /// the connection under a statement.
    Unavailable,
    /// A lock wait gave up (PostgreSQL 55P03, MySQL 1205): another transaction holds the key.
    LockTimeout,
    /// A serialization failure, deadlock or busy database: retrying may succeed.
    Transient,
    /// Anything else.
    Other,
}

impl Failure {
    /// The failure an error with SQLSTATE (or SQLite result code) `code` and, on the MySQL
    /// protocol, error number `number` is; `None` when the codes say nothing idem knows.
    pub fn of_code(code: &str, number: Option<u16>) -> Option<Failure> {
        Some(match (code, number) {
            ("42P01", _) | (_, Some(1146)) => Failure::MissingTable,
            ("55P03", _) | (_, Some(1205)) => Failure::LockTimeout,
            // A deadlock victim, a serialization failure, and on Galera a certification
            // failure at COMMIT or a brute-force abort by another node's write (all 1213).
            ("40001" | "40P01", _) | (_, Some(1213)) => Failure::Transient,
            // Galera: the node is not part of the primary component (being restarted,
            // partitioned away, or still joining): no service on this node for now.
            (_, Some(1047)) => Failure::Unavailable,
            // The server ended the connection under the statement: PostgreSQL's lost or
            // refused connections (08000, 08001, 08003, 08004, 08006; not 08007, whose
            // commit may have happened, nor 08P01, a protocol violation) and shutdowns (57P01
            // a terminated backend, as at a failover; 57P02, 57P03), MySQL's killed
            // connection (1927) and shutdown (1053). A retry on a new connection may succeed.
            ("08000" | "08001" | "08003" | "08004" | "08006", None)
            | ("57P01" | "57P02" | "57P03", None)
            | (_, Some(1927 | 1053)) => Failure::Unavailable,
            // SQLite: SQLITE_BUSY and SQLITE_LOCKED, with their extended codes.
            ("5" | "6" | "261" | "262" | "517", None) => Failure::Transient,
            _ => return None,
        })
    }

    /// Whether an error's message says the ledger table is missing (SQLite gives no code).
    pub fn names_missing_ledger(message: &str) -> bool {
        message.contains(&format!("no such table: {}", crate::LEDGER_TABLE))
    }
}

impl Failure {
    /// The idem error for database error `e`, of this kind, met while `doing` something:
    /// [`Error::Unavailable`] for a lost connection, [`Error::Conflict`] for a transient
    /// failure (the engine runs the call again), else [`Error::Store`]. A missing ledger
    /// names the fix, `create_tables` (how this store's users create it).
    pub fn error<E>(self, doing: &str, e: E, create_tables: &str) -> Error
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let message = match self {
            Failure::MissingTable => {
                return Error::store(
                    format!(
                        "the ledger table `{}` is missing: {create_tables}",
                        crate::LEDGER_TABLE
                    ),
                    e,
                );
            }
            Failure::Unavailable => {
                return Error::Unavailable {
                    message: format!("no database connection while {doing} ({e})"),
                    retry_after: std::time::Duration::from_secs(1),
                };
            }
            Failure::Transient => return Error::conflict(doing),
            Failure::LockTimeout => format!("lock wait timed out while {doing}"),
            Failure::Other => format!("database error while {doing}"),
        };
        Error::store(message, e)
    }
}

/// The error of a record whose claim another call took over before it was written (its
/// fenced update changed no row).
pub fn claim_lost() -> Error {
    Error::Store {
        message: "the claim was lost before its result was recorded".to_owned(),
        source: None,
    }
}

#[cfg(test)]
mod tests {
    use super::Failure;

    #[test]
    fn codes() {
        assert_eq!(Failure::of_code("40P01", None), Some(Failure::Transient));
        assert_eq!(
            Failure::of_code("HY000", Some(1213)),
            Some(Failure::Transient)
        );
        assert_eq!(
            Failure::of_code("HY000", Some(1205)),
            Some(Failure::LockTimeout)
        );
        assert_eq!(Failure::of_code("42P01", None), Some(Failure::MissingTable));
        assert_eq!(Failure::of_code("517", None), Some(Failure::Transient));
        assert_eq!(Failure::of_code("23505", None), None);
        for (code, number) in [("57P01", None), ("08006", None), ("70100", Some(1927))] {
            let failure = Failure::of_code(code, number);
            assert_eq!(failure, Some(Failure::Unavailable), "{code} {number:?}");
        }
        // The commit may have happened; the peer broke the protocol: not an outage.
        assert_eq!(Failure::of_code("08007", None), None);
        assert_eq!(Failure::of_code("08P01", None), None);
    }
}
