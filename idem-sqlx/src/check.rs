//! The pre-deploy check of an answer type that changed ([`idem_sql::check`], written once for
//! every driver), on sqlx's pools.

pub use idem_sql::check::{AnswerCheck, MAX_LISTED, UnreadableRecord};
use sqlx::Pool;

use crate::{Backend, Sqlx};

idem_sql::check_entries!([DB: Backend] Pool<DB>, Sqlx<DB>);
