//! The pre-deploy check of an answer type that changed ([`idem_sql::check`], written once for
//! every driver), on SeaORM's connections.

use idem_sql::Handle;
pub use idem_sql::check::{AnswerCheck, MAX_LISTED, UnreadableRecord};

use crate::SeaOrm;

idem_sql::check_entries!([C: Handle<SeaOrm>] C, SeaOrm);
