use super::*;
use crate::render::with_ids;

/// Every statement table: each flavour's.
fn every_table() -> Vec<Sql> {
    [
        Flavour::Postgres,
        Flavour::MariaDb,
        Flavour::Sqlite,
        Flavour::MySql8,
        Flavour::Galera,
    ]
    .map(Sql::new)
    .into()
}

/// Every statement of `sql` as it runs (`{ids}` lists filled with two ids).
fn every_statement(sql: &Sql) -> Vec<String> {
    let purge = match &sql.ledger.purge {
        Purge::ByIndex(purge) => vec![purge],
        Purge::Sweep {
            bound,
            delete,
            delete_rest,
        } => vec![bound, delete, delete_rest],
    };
    let statements = [
        &sql.ledger.claim,
        &sql.ledger.claim_nowait,
        &sql.ledger.read_locked,
        &sql.ledger.take_over,
        &sql.ledger.record,
        &sql.ledger.select_now,
        &sql.ledger.savepoint,
        &sql.ledger.rollback_to_savepoint,
        &sql.lease.select_steps,
        &sql.lease.insert_step,
        &sql.lease.delete_steps,
        &sql.lease.renew_lease,
        &sql.lease.complete_lease,
        &sql.lease.release_lease,
        &sql.lease.expired_leases,
        &sql.lease.release_by_hand,
        &sql.lease.stuck_leases,
        &sql.lease.purge_orphaned_steps,
        &sql.outbox.insert_message_in_aggregate,
        &sql.outbox.insert_message,
        &sql.outbox.claim_messages,
        &sql.outbox.select_eligible,
        &sql.outbox.lock_claimable,
        &sql.outbox.lease_messages,
        &sql.outbox.mark_published,
        &sql.outbox.mark_failed,
        &sql.outbox.purge_published,
        &sql.outbox.outbox_health,
        &sql.outbox.list_dead,
        &sql.outbox.retry_dead,
        &sql.inbox.record_dead_letter,
        &sql.completer.insert_call,
        &sql.completer.delete_call,
        &sql.completer.due_calls,
        &sql.completer.next_due_in,
        &sql.completer.unregistered_calls,
        &sql.completer.begin_attempt,
        &sql.completer.note_call_error,
        &sql.completer.give_up,
        &sql.completer.note_final_phase,
        &sql.completer.owe_hook,
        &sql.completer.forget_given_up,
        &sql.completer.purge_orphaned_calls,
        &sql.inspect.existing_tables,
        &sql.inspect.inspect_record,
        &sql.inspect.inspect_steps,
        &sql.inspect.inspect_call,
        &sql.inspect.ids_in_range,
        &sql.inspect.list_records,
    ];
    [
        &sql.ledger.tables,
        &sql.lease.tables,
        &sql.completer.tables,
        &sql.outbox.tables,
    ]
    .into_iter()
    .flat_map(|tables| tables.create.iter().chain(&tables.drop))
    .chain(statements)
    .chain(purge)
    .chain(sql.outbox.bump_head.iter())
    .filter(|statement| !statement.is_empty())
    .map(|statement| with_ids(sql.dialect, statement, 2).replace("{limit}", "10"))
    .collect()
}

#[test]
fn every_name_in_a_template_is_spliced() {
    for sql in every_table() {
        for statement in every_statement(&sql) {
            assert!(!statement.contains('{'), "{:?}: {statement}", sql.flavour);
        }
    }
}

#[test]
fn postgres_placeholders_are_numbered_in_order() {
    for statement in every_statement(Sql::of(Flavour::Postgres)) {
        assert!(!statement.contains('?'), "{statement}");
        let mut highest = 0;
        for number in statement.split('$').skip(1) {
            let digits: String = number.chars().take_while(char::is_ascii_digit).collect();
            let n: u32 = digits.parse().expect(&statement);
            // A placeholder is the next number, or one already bound (the claim's `id = $1`).
            assert!(n <= highest + 1, "${n} after ${highest}: {statement}");
            highest = highest.max(n);
        }
    }
    let sql = Sql::of(Flavour::Postgres);
    assert!(
        sql.ledger
            .claim
            .contains("VALUES ($1, $2, $3, $4, $5, $6, 0, NULL,")
    );
    assert!(
        sql.ledger
            .claim
            .contains("+ $7) ON CONFLICT (id) DO NOTHING RETURNING owner,")
    );
    assert!(
        sql.ledger
            .claim
            .ends_with("WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)")
    );
    assert!(sql.ledger.record.contains("WHERE id = $3 AND owner = $4"));
}

#[test]
fn id_lists_are_numbered_after_the_leading_placeholders() {
    let sql = &Sql::of(Flavour::Postgres).outbox.mark_published;
    let filled = with_ids(Dialect::Postgres, sql, 3);
    assert!(filled.contains("locked_by = $1"), "{filled}");
    assert!(filled.ends_with("id IN ($2, $3, $4)"), "{filled}");
    let sql = &Sql::of(Flavour::MariaDb).outbox.mark_published;
    let filled = with_ids(Dialect::MySql, sql, 2);
    assert!(filled.ends_with("id IN (?, ?)"), "{filled}");
}

#[test]
fn expiry_and_leases_are_measured_on_the_database_clock() {
    for sql in &every_table() {
        let backend = sql.flavour;
        let purge = match &sql.ledger.purge {
            Purge::ByIndex(purge) => vec![purge],
            Purge::Sweep {
                delete,
                delete_rest,
                ..
            } => vec![delete, delete_rest],
        };
        let clocked = [
            &sql.ledger.claim,
            &sql.ledger.read_locked,
            &sql.ledger.take_over,
        ]
        .into_iter()
        .chain(purge)
        .chain([
            &sql.lease.renew_lease,
            &sql.lease.complete_lease,
            &sql.lease.release_lease,
            &sql.lease.expired_leases,
        ]);
        for statement in clocked {
            assert!(statement.contains(sql.now), "{backend:?}: {statement}");
        }
    }
}

#[test]
fn the_mysql_8_family_uses_no_mariadb_only_syntax() {
    let mysql8 = Sql::new(Flavour::MySql8);
    for statement in every_statement(&mysql8) {
        assert!(!statement.contains("RETURNING"), "{statement}");
        assert!(!statement.contains("SET STATEMENT"), "{statement}");
    }
    assert!(
        !mysql8.ledger.claim_locks_row,
        "no row comes back to decide on"
    );
}

/// Writes every statement of every flavour to the file `IDEM_SQL_DUMP` names, one per line,
/// so that a change to the statements' code can be checked to render the same text (diff two
/// dumps).
#[test]
fn dump_every_statement() {
    let Ok(path) = std::env::var("IDEM_SQL_DUMP") else {
        return;
    };
    let mut out = String::new();
    for (name, sql) in ["postgres", "mariadb", "sqlite", "mysql8", "galera"]
        .into_iter()
        .zip(every_table())
    {
        for statement in every_statement(&sql) {
            out.push_str(&format!("{name}\t{statement}\n"));
        }
        out.push_str(&format!(
            "{name}\tflags {} {} {} {} {:?} {:?} {:?}\n",
            sql.ledger.claim_locks_row,
            sql.ledger.claim_by_read,
            sql.ledger.claim_at_once,
            sql.now,
            sql.ledger.before_nowait,
            sql.ledger.after_nowait,
            sql.lease.delete_steps_by_key
        ));
        out.push_str(&format!("{name}\t{}\n", sql.inbox.record_dead_letter));
        out.push_str(&format!("{name}\t{}\n", sql.ledger.live_answers));
    }
    std::fs::write(path, out).expect("dump");
}
