//! A statement with the values of its placeholders: what a store executes. Each feature's
//! binders (`Ledger::claim`, `Lease::renew`, …) build one next to the statement's text, so the
//! order of the values cannot drift from the order of the placeholders.

use std::borrow::Cow;

use crate::Column;

/// A value bound to a placeholder, named by its SQL type rather than by a driver's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Param {
    /// `BIGINT`.
    I64(i64),
    /// `INTEGER`.
    I32(i32),
    /// `SMALLINT`.
    I16(i16),
    /// `BYTEA` / `BLOB` / `BINARY`; `None` is `NULL`.
    Bytes(Option<Vec<u8>>),
    /// `VARCHAR` / `TEXT`; `None` is `NULL`.
    Text(Option<String>),
}

impl From<i64> for Param {
    fn from(v: i64) -> Self {
        Param::I64(v)
    }
}

impl From<i32> for Param {
    fn from(v: i32) -> Self {
        Param::I32(v)
    }
}

impl From<i16> for Param {
    fn from(v: i16) -> Self {
        Param::I16(v)
    }
}

impl From<&[u8]> for Param {
    fn from(v: &[u8]) -> Self {
        Param::Bytes(Some(v.to_vec()))
    }
}

impl From<Vec<u8>> for Param {
    fn from(v: Vec<u8>) -> Self {
        Param::Bytes(Some(v))
    }
}

impl From<&str> for Param {
    fn from(v: &str) -> Self {
        Param::Text(Some(v.to_owned()))
    }
}

impl From<String> for Param {
    fn from(v: String) -> Self {
        Param::Text(Some(v))
    }
}

impl From<Option<String>> for Param {
    fn from(v: Option<String>) -> Self {
        Param::Text(v)
    }
}

/// A statement's text and the values of its placeholders, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound<'s> {
    /// The statement, placeholders in the dialect's form.
    pub sql: Cow<'s, str>,
    /// One value per placeholder, in order.
    pub params: Vec<Param>,
    /// The types of the columns the statement returns, in order (empty: it returns no rows,
    /// or its rows are not read).
    pub columns: &'static [Column],
}

impl<'s> Bound<'s> {
    /// `sql` with `params` bound to its placeholders.
    pub fn new(sql: &'s str, params: impl Into<Vec<Param>>) -> Self {
        Bound {
            sql: Cow::Borrowed(sql),
            params: params.into(),
            columns: &[],
        }
    }

    /// `sql` and `params` of a statement whose text was made for these values (an id list
    /// filled in).
    pub fn owned(sql: String, params: Vec<Param>) -> Bound<'static> {
        Bound {
            sql: Cow::Owned(sql),
            params,
            columns: &[],
        }
    }

    /// This statement, whose rows have `columns`, in order.
    #[must_use]
    pub fn reads(mut self, columns: &'static [Column]) -> Self {
        self.columns = columns;
        self
    }

    /// `sql`, which has no placeholders.
    pub fn unbound(sql: &'s str) -> Self {
        Bound::new(sql, Vec::new())
    }
}
