use super::*;

const BACKENDS: [DbBackend; 3] = [DbBackend::Postgres, DbBackend::MySql, DbBackend::Sqlite];

/// Every statement table: each backend's, and the MySQL 8 family's beside MariaDB's.
fn every_table() -> Vec<Sql> {
    let mut all: Vec<Sql> = BACKENDS.map(|b| Sql::new(b, true)).into();
    all.push(Sql::new(DbBackend::MySql, false));
    all
}

/// Every statement of `sql` as it runs (`{ids}` lists filled with two ids).
fn every_statement(sql: &Sql) -> Vec<String> {
    let purge = match &sql.purge {
        Purge::ByIndex(purge) => vec![purge],
        Purge::Sweep {
            bound,
            delete,
            delete_rest,
        } => vec![bound, delete, delete_rest],
    };
    let statements = [
        &sql.claim,
        &sql.claim_nowait,
        &sql.read_locked,
        &sql.take_over,
        &sql.record,
        &sql.select_now,
        &sql.savepoint,
        &sql.rollback_to_savepoint,
        &sql.select_steps,
        &sql.insert_step,
        &sql.delete_steps,
        &sql.renew_lease,
        &sql.complete_lease,
        &sql.release_lease,
        &sql.expired_leases,
        &sql.release_by_hand,
        &sql.stuck_leases,
        &sql.purge_orphaned_steps,
        &sql.insert_message_in_aggregate,
        &sql.insert_message,
        &sql.claim_messages,
        &sql.select_eligible,
        &sql.lock_claimable,
        &sql.lease_messages,
        &sql.mark_published,
        &sql.mark_failed,
        &sql.purge_published,
        &sql.outbox_health,
        &sql.list_dead,
        &sql.retry_dead,
        &sql.record_dead_letter,
        &sql.insert_call,
        &sql.delete_call,
        &sql.due_calls,
        &sql.next_due_in,
        &sql.unregistered_calls,
        &sql.begin_attempt,
        &sql.note_call_error,
        &sql.give_up,
        &sql.note_final_phase,
        &sql.owe_hook,
        &sql.forget_given_up,
        &sql.purge_orphaned_calls,
        &sql.existing_tables,
        &sql.inspect_record,
        &sql.inspect_steps,
        &sql.inspect_call,
        &sql.ids_in_range,
        &sql.list_records,
    ];
    [
        &sql.ledger_tables,
        &sql.steps_tables,
        &sql.calls_tables,
        &sql.outbox_tables,
    ]
    .into_iter()
    .flat_map(|tables| tables.create.iter().chain(&tables.drop))
    .chain(statements)
    .chain(purge)
    .chain(sql.bump_head.iter())
    .filter(|statement| !statement.is_empty())
    .map(|statement| with_ids(sql.backend, statement, 2).replace("{limit}", "10"))
    .collect()
}

#[test]
fn every_name_in_a_template_is_spliced() {
    for sql in every_table() {
        for statement in every_statement(&sql) {
            assert!(!statement.contains('{'), "{:?}: {statement}", sql.backend);
        }
    }
}

#[test]
fn postgres_placeholders_are_numbered_in_order() {
    for statement in every_statement(Sql::of(DbBackend::Postgres)) {
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
    let sql = Sql::of(DbBackend::Postgres);
    assert!(
        sql.claim
            .contains("VALUES ($1, $2, $3, $4, $5, $6, 0, NULL,")
    );
    assert!(
        sql.claim
            .contains("+ $7) ON CONFLICT (id) DO NOTHING RETURNING owner,")
    );
    assert!(
        sql.claim
            .ends_with("WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM claimed)")
    );
    assert!(sql.record.contains("WHERE id = $3 AND owner = $4"));
}

#[test]
fn id_lists_are_numbered_after_the_leading_placeholders() {
    let sql = &Sql::of(DbBackend::Postgres).mark_published;
    let filled = with_ids(DbBackend::Postgres, sql, 3);
    assert!(filled.contains("locked_by = $1"), "{filled}");
    assert!(filled.ends_with("id IN ($2, $3, $4)"), "{filled}");
    let sql = &Sql::of(DbBackend::MySql).mark_published;
    let filled = with_ids(DbBackend::MySql, sql, 2);
    assert!(filled.ends_with("id IN (?, ?)"), "{filled}");
}

#[test]
fn expiry_and_leases_are_measured_on_the_database_clock() {
    for sql in &every_table() {
        let backend = sql.backend;
        let purge = match &sql.purge {
            Purge::ByIndex(purge) => vec![purge],
            Purge::Sweep {
                delete,
                delete_rest,
                ..
            } => vec![delete, delete_rest],
        };
        let clocked = [&sql.claim, &sql.read_locked, &sql.take_over]
            .into_iter()
            .chain(purge)
            .chain([
                &sql.renew_lease,
                &sql.complete_lease,
                &sql.release_lease,
                &sql.expired_leases,
            ]);
        for statement in clocked {
            assert!(statement.contains(sql.now), "{backend:?}: {statement}");
        }
    }
}

#[test]
fn the_mysql_8_family_uses_no_mariadb_only_syntax() {
    let mysql8 = Sql::new(DbBackend::MySql, false);
    for statement in every_statement(&mysql8) {
        assert!(!statement.contains("RETURNING"), "{statement}");
        assert!(!statement.contains("SET STATEMENT"), "{statement}");
    }
    assert!(!mysql8.claim_locks_row, "no row comes back to decide on");
}
