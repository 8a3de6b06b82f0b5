//! The rows a statement returns, as every driver hands them to idem: each column read at the
//! type the statement declares for it ([`Bound::columns`](crate::Bound::columns)), integers
//! widened to `i64`. A driver decodes a [`Column`] with one `match`; idem-sql turns the row
//! into its own type once (`ClaimRow::from_row`, `StoredCall`, …), so no store decodes
//! columns by position.
//!
//! The types are declared, not discovered: PostgreSQL refuses an `i64` read of a `SMALLINT`
//! (`state` is one, `attempts` an `INTEGER`), SQLite types a computed column such as `now_ms`
//! only when it has a value, and SeaORM reads a column only as a Rust type it is told.

use std::fmt;

/// The SQL type a statement's column is read as. Any column may be `NULL`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Column {
    /// `SMALLINT` (SQLite: `INTEGER`): read as `i16`, widened.
    I16,
    /// `INTEGER` / `INT`: read as `i32`, widened.
    I32,
    /// `BIGINT` (SQLite: `INTEGER`), and every count and clock reading.
    I64,
    /// `BYTEA` / `BLOB` / `BINARY`.
    Bytes,
    /// `VARCHAR` / `TEXT`.
    Text,
}

/// One column's value as a driver read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// `NULL`.
    Null,
    /// An integer column ([`Column::I16`], [`Column::I32`], [`Column::I64`]), widened.
    Int(i64),
    /// A [`Column::Bytes`] column.
    Bytes(Vec<u8>),
    /// A [`Column::Text`] column.
    Text(String),
}

impl Value {
    /// What the value is, as a decoding error states it.
    const fn kind(&self) -> &'static str {
        match self {
            Value::Null => "NULL",
            Value::Int(_) => "an integer",
            Value::Bytes(_) => "bytes",
            Value::Text(_) => "text",
        }
    }
}

/// A driver's read of a narrower integer column (`None`: `NULL`), widened.
macro_rules! from_int {
    ($($int:ty),+) => {$(
        impl From<Option<$int>> for Value {
            fn from(v: Option<$int>) -> Self {
                v.map_or(Value::Null, |v| Value::Int(i64::from(v)))
            }
        }
    )+};
}
from_int!(i16, i32);

impl From<Option<i64>> for Value {
    fn from(v: Option<i64>) -> Self {
        v.map_or(Value::Null, Value::Int)
    }
}

impl From<Option<Vec<u8>>> for Value {
    fn from(v: Option<Vec<u8>>) -> Self {
        v.map_or(Value::Null, Value::Bytes)
    }
}

impl From<Option<String>> for Value {
    fn from(v: Option<String>) -> Self {
        v.map_or(Value::Null, Value::Text)
    }
}

/// Each of `rows` read by `read` (idem-sql's reader of a statement's rows).
pub fn read_each<T>(rows: Vec<Row>, read: fn(Row) -> Result<T, Decode>) -> Result<Vec<T>, Decode> {
    rows.into_iter().map(read).collect()
}

/// The first of `rows`, if any, read by `read`.
pub fn read_first<T>(
    rows: Vec<Row>,
    read: fn(Row) -> Result<T, Decode>,
) -> Result<Option<T>, Decode> {
    rows.into_iter().next().map(read).transpose()
}

/// A row a statement returned: its columns' values in the statement's order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row(Vec<Value>);

impl Row {
    /// A row of `values`, in the statement's column order.
    pub fn new(values: Vec<Value>) -> Self {
        Row(values)
    }

    /// The row's values, in order.
    pub fn values(&self) -> &[Value] {
        &self.0
    }

    /// The row's one column, an integer (a count, an id, the clock).
    pub fn into_i64(self) -> Result<i64, Decode> {
        self.read().i64()
    }

    /// The row's one column, an integer or `NULL`.
    pub fn into_opt_i64(self) -> Result<Option<i64>, Decode> {
        self.read().opt_i64()
    }

    /// The row's one column, bytes (a key).
    pub fn into_bytes(self) -> Result<Vec<u8>, Decode> {
        self.read().bytes()
    }

    /// The row's one column, text (a name).
    pub fn into_text(self) -> Result<String, Decode> {
        self.read().text()
    }

    /// Reads the row's columns one after the other, in the statement's order.
    pub fn read(self) -> Columns {
        Columns {
            values: self.0.into_iter(),
            at: 0,
        }
    }
}

impl From<Vec<Value>> for Row {
    fn from(values: Vec<Value>) -> Self {
        Row(values)
    }
}

/// A row's columns, read in order: each call takes the next column. A value of another kind
/// than asked, or a missing column, is a [`Decode`] error naming the column.
#[derive(Debug)]
pub struct Columns {
    values: std::vec::IntoIter<Value>,
    at: usize,
}

impl Columns {
    fn take(&mut self, expected: &'static str) -> Result<Value, Decode> {
        let column = self.at;
        self.at += 1;
        self.values.next().ok_or(Decode {
            column,
            expected,
            found: "no such column",
        })
    }

    fn mismatch(&self, expected: &'static str, found: &Value) -> Decode {
        Decode {
            column: self.at - 1,
            expected,
            found: found.kind(),
        }
    }

    /// The next column, an integer that may be `NULL`.
    pub fn opt_i64(&mut self) -> Result<Option<i64>, Decode> {
        match self.take("an integer")? {
            Value::Null => Ok(None),
            Value::Int(v) => Ok(Some(v)),
            other => Err(self.mismatch("an integer", &other)),
        }
    }

    /// The next column, an integer.
    pub fn i64(&mut self) -> Result<i64, Decode> {
        let column = self.at;
        self.opt_i64()?.ok_or(Decode {
            column,
            expected: "an integer",
            found: "NULL",
        })
    }

    /// The next column, an integer that fits `T` ([`Column::I16`], [`Column::I32`]).
    pub fn int<T: TryFrom<i64>>(&mut self) -> Result<T, Decode> {
        let column = self.at;
        T::try_from(self.i64()?).map_err(|_| Decode {
            column,
            expected: "a narrower integer",
            found: "an integer out of its range",
        })
    }

    /// The next column, an integer that fits `T` or `NULL`.
    pub fn opt_int<T: TryFrom<i64>>(&mut self) -> Result<Option<T>, Decode> {
        let column = self.at;
        self.opt_i64()?
            .map(|v| {
                T::try_from(v).map_err(|_| Decode {
                    column,
                    expected: "a narrower integer",
                    found: "an integer out of its range",
                })
            })
            .transpose()
    }

    /// The next column, bytes that may be `NULL`.
    pub fn opt_bytes(&mut self) -> Result<Option<Vec<u8>>, Decode> {
        match self.take("bytes")? {
            Value::Null => Ok(None),
            Value::Bytes(v) => Ok(Some(v)),
            other => Err(self.mismatch("bytes", &other)),
        }
    }

    /// The next column, bytes.
    pub fn bytes(&mut self) -> Result<Vec<u8>, Decode> {
        let column = self.at;
        self.opt_bytes()?.ok_or(Decode {
            column,
            expected: "bytes",
            found: "NULL",
        })
    }

    /// The next column, text that may be `NULL`.
    pub fn opt_text(&mut self) -> Result<Option<String>, Decode> {
        match self.take("text")? {
            Value::Null => Ok(None),
            Value::Text(v) => Ok(Some(v)),
            other => Err(self.mismatch("text", &other)),
        }
    }

    /// The next column, text.
    pub fn text(&mut self) -> Result<String, Decode> {
        let column = self.at;
        self.opt_text()?.ok_or(Decode {
            column,
            expected: "text",
            found: "NULL",
        })
    }
}

/// A column that did not hold what its statement declares: a driver read it at another type,
/// or the table is not the one idem created (a column altered by hand, a table of another
/// version).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decode {
    /// The column's position in the statement's result, from 0.
    pub column: usize,
    /// What idem reads there.
    pub expected: &'static str,
    /// What the row held.
    pub found: &'static str,
}

impl fmt::Display for Decode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "column {} of a row idem read holds {} where idem reads {}: is the table the one \
             `create_tables` (or `idem schema`) made for this version?",
            self.column, self.found, self.expected
        )
    }
}

impl std::error::Error for Decode {}

#[cfg(test)]
mod tests {
    use super::{Decode, Row, Value};

    #[test]
    fn columns_are_read_in_order_and_a_mismatch_names_its_column() {
        let row = Row::new(vec![
            Value::Int(7),
            Value::Null,
            Value::Bytes(vec![1]),
            Value::Text("t".into()),
        ]);
        let mut columns = row.clone().read();
        assert_eq!(columns.i64(), Ok(7));
        assert_eq!(columns.opt_text(), Ok(None));
        assert_eq!(columns.bytes(), Ok(vec![1]));
        assert_eq!(columns.text(), Ok("t".to_owned()));
        assert_eq!(
            columns.i64(),
            Err(Decode {
                column: 4,
                expected: "an integer",
                found: "no such column"
            })
        );

        let mut columns = row.clone().read();
        assert_eq!(
            columns.bytes(),
            Err(Decode {
                column: 0,
                expected: "bytes",
                found: "an integer"
            })
        );
        let mut columns = row.read();
        columns.i64().expect("an integer");
        let null = columns.text().expect_err("NULL is not text");
        assert_eq!((null.column, null.found), (1, "NULL"));
        assert!(null.to_string().contains("column 1"), "{null}");
    }

    #[test]
    fn narrow_integers_refuse_what_does_not_fit() {
        let mut columns = Row::new(vec![Value::Int(1), Value::Int(1 << 20), Value::Null]).read();
        assert_eq!(columns.int::<i16>(), Ok(1));
        assert_eq!(
            columns.int::<i16>().map_err(|e| (e.column, e.found)),
            Err((1, "an integer out of its range"))
        );
        assert_eq!(columns.opt_int::<i32>(), Ok(None));
    }
}
