use super::*;
use crate::statement::render::with_ids;

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
    fn purge_statements(purge: &Purge) -> Vec<&String> {
        match purge {
            Purge::ByIndex(purge) => vec![&purge.delete],
            Purge::Sweep(sweep) => vec![&sweep.bound, &sweep.delete, &sweep.delete_rest],
        }
    }
    let purge = purge_statements(&sql.ledger.purge);
    let purge_without_calls = purge_statements(&sql.ledger.purge_without_calls);
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
        &sql.lease.expired_leases[0],
        &sql.lease.release_by_hand,
        &sql.lease.stuck_leases[0],
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
    .chain(sql.lease.insert_step_fenced.iter())
    .chain(sql.lease.fence_by_write.iter())
    .chain(purge_without_calls)
    .chain([&sql.lease.expired_leases[1], &sql.lease.stuck_leases[1]])
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
        let purge = [&sql.ledger.purge, &sql.ledger.purge_without_calls]
            .into_iter()
            .flat_map(|purge| match purge {
                Purge::ByIndex(purge) => vec![&purge.delete],
                Purge::Sweep(sweep) => vec![&sweep.delete, &sweep.delete_rest],
            });
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
            &sql.lease.expired_leases[0],
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

/// Every binder of every flavour, with sample values.
fn every_bound(sql: &Sql) -> Vec<(&'static str, Bound<'_>)> {
    let row = NewRecord {
        id: vec![1; 32],
        scope: "s".into(),
        principal: String::new(),
        key: "k".into(),
        owner: 7,
        fingerprint: vec![2; 32],
        ttl_ms: 1000,
    };
    let call = NewCall {
        id: vec![1; 32],
        scope: "s".into(),
        args: vec![3],
        ttl_ms: 1000,
    };
    let message = |aggregate: Option<&str>| NewMessage {
        id: "m".into(),
        topic: "t".into(),
        aggregate: aggregate.map(str::to_owned),
        headers: None,
        payload: vec![4],
    };
    let letter = NewDeadLetter {
        consumer: "c".into(),
        message_id: "m".into(),
        subject: "t".into(),
        payload: vec![4],
        error: "e".into(),
        deliveries: 3,
    };
    let id = [1u8; 32];
    let (l, le, c, i, o) = (
        &sql.ledger,
        &sql.lease,
        &sql.completer,
        &sql.inspect,
        &sql.outbox,
    );
    let mut all = vec![
        ("claim", l.claim(&row)),
        ("claim_nowait", l.claim_nowait(&row)),
        ("read_locked", l.read_locked(&id)),
        ("read_row", l.read_row(&id)),
        ("take_over", l.take_over(&id, 8, &id, 1000)),
        ("record", l.record(&row, 1, b"r")),
        (
            "record_or_fail",
            l.record_or_fail(&row, 1, b"r")
                .unwrap_or_else(|| l.record(&row, 1, b"r")),
        ),
        ("select_now", l.select_now()),
        ("savepoint", l.savepoint()),
        ("rollback_to_savepoint", l.rollback_to_savepoint()),
        ("live_answers", l.live_answers("s", 1, &id, 10)),
        ("select_steps", le.select_steps(&id)),
        ("insert_step", le.insert_step(&id, "n", 7, b"r")),
        ("delete_steps", le.delete_steps(&id)),
        ("renew", le.renew(&id, 7, 1000)),
        ("complete", le.complete(&id, 7, 1, b"r".to_vec(), 1000)),
        ("release", le.release(&id, 7)),
        ("release_by_hand", le.release_by_hand(&id)),
        ("expired_leases", le.expired_leases(10, true)),
        ("stuck_leases", le.stuck_leases(1000, 10, true)),
        ("expired_leases without calls", le.expired_leases(10, false)),
        (
            "stuck_leases without calls",
            le.stuck_leases(1000, 10, false),
        ),
        ("purge_orphaned_steps", le.purge_orphaned_steps()),
        ("insert_call", c.insert_call(&call)),
        ("delete_call", c.delete_call(&id)),
        ("due_calls", c.due_calls(&["a", "b"], 10)),
        ("next_due_in", c.next_due_in(&["a", "b"])),
        ("unregistered_calls", c.unregistered_calls(&[])),
        ("begin_attempt", c.begin_attempt(&id, 2, 1000)),
        ("note_call_error", c.note_call_error(&id, "e".into())),
        ("give_up", c.give_up(&id, b"r".to_vec())),
        ("note_final_phase", c.note_final_phase(&id)),
        ("owe_hook", c.owe_hook(&id, 1000)),
        ("forget_given_up", c.forget_given_up(&id)),
        ("purge_orphaned_calls", c.purge_orphaned_calls()),
        ("existing_tables", i.existing_tables()),
        ("inspect record", i.record(&id)),
        ("inspect steps", i.steps(&id)),
        ("inspect call", i.call(&id)),
        ("ids_in_range", i.ids_in_range(&id, &id, 10)),
        ("list_records", i.list_records("s", 1000, None, 10)),
        ("mark_published", o.mark_published(&[1, 2], 7)),
        ("mark_failed", o.mark_failed(1, 7, false, "e".into(), 1000)),
        ("purge_published", o.purge_published(1000, 10)),
        ("outbox_health", o.outbox_health()),
        ("list_dead", o.list_dead(10)),
        ("retry_dead", o.retry_dead("m")),
        ("record_dead_letter", sql.inbox.record_dead_letter(&letter)),
    ];
    if o.claims_in_three_steps() {
        all.push(("select_eligible", o.select_eligible(10)));
        all.push(("lock_claimable", o.lock_claimable(&[1, 2])));
        all.push(("lease_messages", o.lease_messages(&[1, 2], 7, 1000)));
    } else {
        all.push(("claim_messages", o.claim_messages(7, 1000, 10)));
    }
    all.extend(o.stage(&message(None)).into_iter().map(|b| ("stage", b)));
    all.extend(
        o.stage(&message(Some("a")))
            .into_iter()
            .map(|b| ("stage in aggregate", b)),
    );
    if let Some(delete) = le.delete_steps_by_key(&id, &["a".into(), "b".into()]) {
        all.push(("delete_steps_by_key", delete));
    }
    for calls_table in [true, false] {
        match l.purge(calls_table) {
            Purge::ByIndex(purge) => all.push(("purge", purge.delete(10))),
            Purge::Sweep(sweep) => all.extend([
                ("sweep bound", sweep.bound(&id, 10)),
                ("sweep delete", sweep.delete(&id, &id)),
                ("sweep delete_rest", sweep.delete_rest(&id)),
            ]),
        }
    }
    all
}

/// How many values `sql` takes: its `?`s, or on PostgreSQL its highest `$n` (a placeholder
/// may be used twice).
fn placeholders_in(dialect: Dialect, sql: &str) -> usize {
    if dialect != Dialect::Postgres {
        return sql.matches('?').count();
    }
    sql.split('$')
        .skip(1)
        .filter_map(|n| {
            n.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<usize>()
                .ok()
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn every_binder_binds_one_value_per_placeholder() {
    for sql in every_table() {
        for (name, bound) in every_bound(&sql) {
            assert!(
                !bound.sql.contains('{'),
                "{:?} {name}: {}",
                sql.flavour,
                bound.sql
            );
            assert_eq!(
                placeholders_in(sql.dialect, &bound.sql),
                bound.params.len(),
                "{:?} {name}: {}",
                sql.flavour,
                bound.sql
            );
        }
    }
}

/// How many columns `sql` returns, counted in its text: the items of its outermost `SELECT`
/// (after a `WITH`, the main statement's; for `SELECT * … UNION ALL SELECT …`, the second's),
/// or of its `RETURNING`. `None` for a statement that returns no rows.
fn returned_columns(sql: &str) -> Option<usize> {
    // The statement at depth 0: each parenthesised group shown as `()`.
    let mut flat = String::new();
    let mut depth = 0usize;
    for c in sql.chars() {
        match c {
            '(' => {
                if depth == 0 {
                    flat.push_str("()");
                }
                depth += 1;
            }
            ')' => depth -= 1,
            c if depth == 0 => flat.push(c),
            _ => {}
        }
    }
    let mut main = flat.as_str();
    // MariaDB's per-statement settings: `SET STATEMENT a = 0, b = 7 FOR <statement>`.
    if main.starts_with("SET STATEMENT ") {
        main = &main[main.find(" FOR ")? + " FOR ".len()..];
    }
    // One common table expression: `WITH name AS () <statement>`.
    if main.starts_with("WITH ") {
        main = &main[main.find(" AS () ")? + " AS () ".len()..];
    }
    let items = |list: &str| list.split(',').count();
    if let Some(select) = main.strip_prefix("SELECT ") {
        let list = select.split(" FROM ").next().unwrap_or_default();
        if list.trim() == "*" {
            let second = main.split(" UNION ALL SELECT ").nth(1)?;
            return Some(items(second.split(" FROM ").next().unwrap_or_default()));
        }
        return Some(items(list));
    }
    main.split(" RETURNING ").nth(1).map(items)
}

#[test]
fn returned_columns_are_counted_at_the_statement_s_own_level() {
    assert_eq!(
        returned_columns("SELECT a, f(b, c) AS d FROM t WHERE x IN (SELECT y, z FROM u)"),
        Some(2)
    );
    assert_eq!(
        returned_columns("DELETE FROM t WHERE id IN (SELECT id FROM t LIMIT 1)"),
        None
    );
    assert_eq!(
        returned_columns("UPDATE t SET a = 1 RETURNING a, b, c"),
        Some(3)
    );
    assert_eq!(
        returned_columns("SELECT (SELECT COUNT(*) FROM t) AS n, 1 AS m"),
        Some(2)
    );
}

/// Every statement whose rows idem reads declares their columns ([`Bound::columns`]), as many
/// as it returns, and no other statement declares any: a driver reads each column at its
/// declared type, so a column added to a statement without its type (or the reverse) would
/// misread every row after it.
#[test]
fn every_reading_binder_declares_its_columns() {
    for sql in every_table() {
        for (name, bound) in every_bound(&sql) {
            let returned = returned_columns(&bound.sql);
            // The MySQL 8 family's claim is an upsert that returns nothing; the store then
            // reads the key with `read_locked`, whose rows are the claim's.
            let upsert_without_returning = sql.flavour == Flavour::MySql8
                && matches!(name, "claim" | "claim_nowait")
                && returned.is_none();
            if upsert_without_returning {
                assert_eq!(bound.columns, ClaimRow::COLUMNS);
                continue;
            }
            assert_eq!(
                returned,
                (!bound.columns.is_empty()).then_some(bound.columns.len()),
                "{:?} {name}: declares {:?} for {}",
                sql.flavour,
                bound.columns,
                bound.sql
            );
        }
    }
}

/// A row of `columns` as a driver would hand it over: each column a value of its type.
fn row_of(columns: &[Column]) -> Row {
    Row::new(
        columns
            .iter()
            .map(|column| match column {
                Column::I16 | Column::I32 | Column::I64 => Value::Int(1),
                Column::Bytes => Value::Bytes(vec![1; 32]),
                Column::Text => Value::Text("t".into()),
            })
            .collect(),
    )
}

/// Each row type reads exactly the columns its statements declare: a row of them decodes,
/// a row one column short does not.
#[test]
fn each_row_type_reads_the_columns_its_statements_declare() {
    fn decodes<T>(columns: &[Column], from_row: fn(Row) -> Result<T, Decode>) -> bool {
        let short = &columns[..columns.len() - 1];
        from_row(row_of(columns)).is_ok() && from_row(row_of(short)).is_err()
    }
    for sql in every_table() {
        let id = [1u8; 32];
        let flavour = sql.flavour;
        let row = |b: Bound<'_>| b.columns;
        assert!(
            decodes(row(sql.ledger.read_locked(&id)), ClaimRow::from_row),
            "{flavour:?}"
        );
        assert!(
            decodes(row(sql.lease.select_steps(&id)), read_step),
            "{flavour:?}"
        );
        for calls_table in [true, false] {
            let expired = row(sql.lease.expired_leases(1, calls_table));
            assert!(decodes(expired, ExpiredLease::from_row), "{flavour:?}");
            let stuck = row(sql.lease.stuck_leases(1, 1, calls_table));
            assert!(decodes(stuck, StuckLease::from_row), "{flavour:?}");
        }
        let due = row(sql.completer.due_calls(&["s"], 1));
        assert!(decodes(due, read_stored_call), "{flavour:?}");
        let dead = row(sql.outbox.list_dead(1));
        assert!(decodes(dead, DeadMessage::from_row), "{flavour:?}");
        let claimed = if sql.outbox.claims_in_three_steps() {
            row(sql.outbox.lock_claimable(&[1]))
        } else {
            row(sql.outbox.claim_messages(1, 1, 1))
        };
        assert!(decodes(claimed, ClaimedRow::from_row), "{flavour:?}");
    }
    // A resumable call's NULL attempts (not resumable) and a NULL response read as absent.
    let mut values = row_of(ExpiredLease::COLUMNS).values().to_vec();
    *values.last_mut().expect("attempts") = Value::Null;
    let lease = ExpiredLease::from_row(Row::new(values)).expect("a NULL attempts column");
    assert!(!lease.resumable);
    let mut values = row_of(ClaimRow::COLUMNS).values().to_vec();
    values[3] = Value::Null;
    assert_eq!(
        ClaimRow::from_row(Row::new(values)).map(|r| r.response),
        Ok(None)
    );
}

/// The schema files under `idem-sql/schema/` are what [`schema`] renders: they cannot drift
/// from the statements `create_tables` runs. `IDEM_SCHEMA_WRITE=1` rewrites them.
#[test]
fn the_schema_files_are_the_rendered_ddl() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schema");
    let write = std::env::var("IDEM_SCHEMA_WRITE").is_ok_and(|v| v == "1");
    for (dialect, dir) in SCHEMA_DIALECTS {
        for family in Family::ALL {
            let path = root.join(dir).join(format!("{}.sql", family.name()));
            let rendered = schema(dialect, family);
            if write {
                std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
                std::fs::write(&path, &rendered).expect("write");
            }
            let file = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                panic!("{}: {e} (IDEM_SCHEMA_WRITE=1 writes it)", path.display())
            });
            assert_eq!(
                file,
                rendered,
                "{} is stale: IDEM_SCHEMA_WRITE=1 rewrites it",
                path.display()
            );
            assert!(!file.contains('{'), "{}", path.display());
        }
    }
}

/// What [`Sql::common`] promises: the MySQL families (MariaDB, a Galera node, the MySQL 8
/// family) render every statement alike except the claim's and the lease's fence (Galera's
/// is a write: `fence_by_write`, and no `insert_step_fenced`), so a caller that does not know
/// the server's family may run any other.
#[test]
fn the_mysql_families_differ_only_in_the_claim() {
    let outside_the_claim = |flavour| {
        let sql = Sql::new(flavour);
        let claim: Vec<&String> = [
            &sql.ledger.claim,
            &sql.ledger.claim_nowait,
            &sql.ledger.read_locked,
            &sql.ledger.read_row,
        ]
        .into_iter()
        .chain(&sql.lease.insert_step_fenced)
        .chain(&sql.lease.fence_by_write)
        .collect();
        every_statement(&sql)
            .into_iter()
            .filter(|statement| !claim.contains(&statement))
            .collect::<Vec<_>>()
    };
    let mariadb = outside_the_claim(Flavour::MariaDb);
    assert!(mariadb.len() > 60, "{} statements", mariadb.len());
    for flavour in [Flavour::Galera, Flavour::MySql8] {
        assert_eq!(outside_the_claim(flavour), mariadb, "{flavour:?}");
    }
    assert!(std::ptr::eq(
        Sql::common(Dialect::MySql),
        Sql::of(Flavour::MariaDb)
    ));
}

/// A service may talk to MariaDB and to MySQL 8: each server keeps the family learnt of it, and
/// a server that did not answer is asked again next time.
#[test]
fn each_mysql_server_keeps_its_own_family() {
    let mysql8 = MySqlServer::new("mysql8.invalid", 3306, Some("shop"));
    let mariadb = MySqlServer::new("mariadb.invalid", 3306, Some("shop"));
    let down = MySqlServer::new("down.invalid", 3306, None);
    assert_eq!(mysql8.learnt(), None);
    assert_eq!(mysql8.learn(Some("8.0.36"), None), Flavour::MySql8);
    let expected = mysql_flavour(Some("10.11.19-MariaDB"), Some(0));
    assert_eq!(mariadb.learn(Some("10.11.19-MariaDB"), Some(0)), expected);
    assert_eq!(mysql8.learnt(), Some(Flavour::MySql8));
    assert_eq!(mariadb.learnt(), Some(expected));
    down.learn(None, None);
    assert_eq!(down.learnt(), None);
}
