//! The commands: each reads (or, when asked, writes) through `idem-sea-orm` and prints a
//! table for people or, with `--json`, one JSON document for scripts.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use idem_core::RecordStatus;
use idem_sea_orm::inspect::RecordView;
use idem_sea_orm::sea_orm::DatabaseConnection;
use idem_sea_orm::{LEDGER_TABLE, OUTBOX_TABLE};
use serde_json::{Value, json};

use crate::database::require_tables;
use crate::format::{
    hex, http_answer, indented_json, iso8601, json_payload, one_line, relative, span, table,
    unquoted_key, when,
};
use crate::{Failure, Found, InspectArgs, print, print_json};

/// What idem does not record, said where a reader would look for it.
const REPLAYS_NOT_RECORDED: &str =
    "not recorded (a replay reads the record and writes nothing, so idem keeps no count)";

/// The words for a record's state.
fn state_name(view: &RecordView) -> String {
    match view.status() {
        Some(RecordStatus::Pending) => "in progress".to_owned(),
        Some(RecordStatus::Completed) => "completed".to_owned(),
        Some(RecordStatus::Failed) => "failed (final error)".to_owned(),
        Some(RecordStatus::GaveUp) => "gave up".to_owned(),
        _ => format!("unknown state {}", view.record.state),
    }
}

/// What leaves no record, said when a lookup finds none: a reader who saw a key answered
/// (a 409, a 503) looks for it here.
const NO_RECORD_CASES: &str = "idem keeps no record of a call that was never claimed, that was \
    refused before its claim (invalid key, key in flight), or whose body returned an error that \
    is not final (a transient error, `invalid-transition`, a conflict: rolled back, the key is \
    free), nor of one purged after it ended and expired";

/// How many records an ambiguous id prefix names.
const AMBIGUOUS_SHOWN: u32 = 5;

/// The record `args` name, and how to say what was looked for: by scope and key (bare, or
/// quoted as the client's header carried it), or by its id or any unique start of it. An
/// empty id: no record starts with the prefix.
async fn resolve(
    db: &DatabaseConnection,
    args: &InspectArgs,
) -> Result<(Vec<u8>, String), Failure> {
    let resolved = match (&args.id, &args.scope, &args.key) {
        (Some(prefix), _, _) => match prefix.whole() {
            Some(id) => (id.to_vec(), format!("id {}", hex(&id))),
            None => {
                let limit = AMBIGUOUS_SHOWN + 1;
                let ids = idem_sea_orm::inspect::ids_with_prefix(db, prefix, limit).await?;
                match ids.as_slice() {
                    [] => (Vec::new(), format!("an id starting with {prefix}")),
                    [id] => (id.clone(), format!("id {}", hex(id))),
                    several => {
                        let shown: Vec<String> = several
                            .iter()
                            .take(AMBIGUOUS_SHOWN as usize)
                            .map(|id| hex(id))
                            .collect();
                        let more = if several.len() > AMBIGUOUS_SHOWN as usize {
                            ", …"
                        } else {
                            ""
                        };
                        return Err(Failure(format!(
                            "{} records start with {prefix}: {}{more}; give more digits",
                            if more.is_empty() {
                                several.len().to_string()
                            } else {
                                format!("{AMBIGUOUS_SHOWN}+")
                            },
                            shown.join(", ")
                        )));
                    }
                }
            }
        },
        (None, Some(scope), Some(key)) => {
            let principal = &args.principal;
            let id = idem_core::record_id(scope, principal, key);
            let looked_for = format!(
                "scope `{scope}`, key `{key}`{}",
                if principal.is_empty() {
                    " (no principal: pass --principal if the handler keys by one)".to_owned()
                } else {
                    format!(", principal `{principal}`")
                }
            );
            match unquoted_key(key) {
                // A key pasted with its header's quotes: the record is under the key inside
                // them, unless a handler took the quotes as part of its key.
                Some(bare) if idem_sea_orm::inspect::record(db, &id).await?.is_none() => (
                    idem_core::record_id(scope, principal, &bare).to_vec(),
                    looked_for,
                ),
                _ => (id.to_vec(), looked_for),
            }
        }
        // clap requires either --id or both --scope and --key.
        _ => return Err(Failure("give --scope and --key, or --id".to_owned())),
    };
    Ok(resolved)
}

/// `idem inspect`: one record, its answer, lease, steps and stored call; found by scope and
/// key (bare, or quoted as the client's header carried it) or by its id or the start of it.
pub(crate) async fn inspect(
    db: &DatabaseConnection,
    args: &InspectArgs,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[LEDGER_TABLE]).await?;
    let (id, looked_for) = resolve(db, args).await?;
    let view = match id.is_empty() {
        true => None,
        false => idem_sea_orm::inspect::record(db, &id).await?,
    };
    let Some(view) = view else {
        if json {
            print_json(
                &json!({ "found": false, "id": hex(&id), "no_record_cases": NO_RECORD_CASES }),
            )?;
        } else {
            let id = if id.is_empty() {
                String::new()
            } else {
                format!(" (record id {})", hex(&id))
            };
            eprintln!("no record for {looked_for}{id}: {NO_RECORD_CASES}");
        }
        return Ok(Found::No);
    };
    if json {
        print_json(&inspect_json(&view))?;
    } else {
        print(&inspect_text(&view))?;
    }
    Ok(Found::Yes)
}

fn inspect_json(view: &RecordView) -> Value {
    let in_progress = view.status() == Some(RecordStatus::Pending);
    let lease = in_progress.then(|| {
        json!({
            "owner_token": view.record.owner,
            "ends_at": iso8601(view.record.expires_at_ms),
            "ends_at_ms": view.record.expires_at_ms,
            "ended": view.record.expires_at_ms <= view.now_ms,
        })
    });
    let steps: Vec<Value> = view
        .steps
        .iter()
        .map(|step| {
            json!({
                "name": step.name,
                "token": step.token,
                "value": json_payload(&step.value),
                "recorded_at": iso8601(step.created_at_ms),
            })
        })
        .collect();
    let call = view.call.as_ref().map(|call| {
        json!({
            "attempts": call.attempts,
            "last_error": call.last_error,
            "give_up_hook_owed": call.hook_owed,
            "next_attempt_at": iso8601(call.next_attempt_at_ms),
            "stored_at": iso8601(call.created_at_ms),
            "args": json_payload(&call.args),
        })
    });
    json!({
        "found": true,
        "id": hex(&view.record.id),
        "scope": view.record.scope,
        "principal": view.record.principal,
        "key": view.record.idem_key,
        "state": state_name(view),
        "state_code": view.record.state,
        "fingerprint": hex(&view.record.fingerprint),
        "owner_token": view.record.owner,
        "created_at": iso8601(view.record.created_at_ms),
        "created_at_ms": view.record.created_at_ms,
        "expires_at": iso8601(view.record.expires_at_ms),
        "expires_at_ms": view.record.expires_at_ms,
        "expired": view.record.expires_at_ms <= view.now_ms,
        "database_now": iso8601(view.now_ms),
        "database_now_ms": view.now_ms,
        "lease": lease,
        "steps": steps,
        "call": call,
        "answer": view.record.response.as_deref().map(answer_payload),
        "answer_version": view.record.response.as_deref().and_then(idem_core::versioned::recorded_version),
        "replays": Value::Null,
        "replays_note": REPLAYS_NOT_RECORDED,
    })
}

fn inspect_text(view: &RecordView) -> String {
    let now = view.now_ms;
    let mut out = String::new();
    let mut field = |name: &str, value: &str| {
        let _ = writeln!(out, "{name:<12} {value}");
    };
    field("record", &hex(&view.record.id));
    field("scope", &view.record.scope);
    if !view.record.principal.is_empty() {
        field("principal", &view.record.principal);
    }
    field("key", &view.record.idem_key);
    field(
        "state",
        &format!("{} ({})", state_name(view), view.record.state),
    );
    field("fingerprint", &hex(&view.record.fingerprint));
    if let Some(version) = view
        .record
        .response
        .as_deref()
        .and_then(idem_core::versioned::recorded_version)
        .filter(|&version| version > 1)
    {
        // Written by a type that declares `Versioned::VERSION`; older readers upcast it.
        field(
            "answer ver.",
            &format!("{version} (the answer type's Versioned::VERSION)"),
        );
    }
    field("created", &when(view.record.created_at_ms, now));
    let status = view.status();
    if status == Some(RecordStatus::Pending) {
        let ended = view.record.expires_at_ms <= now;
        field(
            "lease",
            &format!(
                "token {}, {} {}",
                view.record.owner,
                if ended { "ended" } else { "ends" },
                when(view.record.expires_at_ms, now)
            ),
        );
        if ended {
            field(
                "",
                if view.call.is_some() {
                    "the holder is gone: a completer (resumable call) or a client retry takes it over"
                } else {
                    "the holder is gone: a client retry takes it over (not resumable)"
                },
            );
        }
    } else {
        let expiry = if view.record.expires_at_ms <= now {
            "expired"
        } else {
            "expires"
        };
        field(expiry, &when(view.record.expires_at_ms, now));
    }
    field("replays", REPLAYS_NOT_RECORDED);
    if let Some(call) = &view.call {
        let mut text = format!(
            "resumable; {} completer attempt{}",
            call.attempts,
            if call.attempts == 1 { "" } else { "s" }
        );
        if call.hook_owed {
            text.push_str("; give-up hook owed (not yet run to success)");
        } else if status == Some(RecordStatus::Pending) {
            // A completer takes the call once its lease has ended and its backoff passed.
            let due_at = call.next_attempt_at_ms.max(view.record.expires_at_ms);
            if due_at <= now {
                text.push_str("; due now for a completer");
            } else {
                let _ = write!(text, "; next completer attempt {}", relative(due_at, now));
            }
        }
        field("call", &text);
        if let Some(error) = &call.last_error {
            field("last error", &one_line(error));
        }
        out.push_str("arguments\n");
        out.push_str(&indented_json(&json_payload(&call.args), 2));
    }
    if !view.steps.is_empty() {
        let _ = writeln!(out, "steps ({})", view.steps.len());
        for step in &view.steps {
            let _ = writeln!(
                out,
                "  {}  token {}  recorded {}",
                step.name,
                step.token,
                when(step.created_at_ms, now)
            );
            out.push_str(&indented_json(&json_payload(&step.value), 4));
        }
    }
    match (status, &view.record.response) {
        (Some(RecordStatus::GaveUp), Some(payload)) => {
            let record = json_payload(payload);
            let attempts = record["attempts"].as_u64().unwrap_or(0);
            let _ = writeln!(
                out,
                "{:<12} after {attempts} completer attempt{}: {}",
                "gave up",
                if attempts == 1 { "" } else { "s" },
                record["reason"]
                    .as_str()
                    .map_or_else(|| record["reason"].to_string(), one_line)
            );
        }
        (Some(RecordStatus::Failed), Some(payload)) => {
            let _ = writeln!(out, "answer (final error, replayed to every retry)");
            out.push_str(&indented_json(&json_payload(payload), 2));
        }
        (_, Some(payload)) => match http_answer(&json_payload(payload)) {
            Some(http) => out.push_str(&http_text(&http)),
            None => {
                let _ = writeln!(out, "answer");
                out.push_str(&indented_json(&json_payload(payload), 2));
            }
        },
        (_, None) => {
            let _ = writeln!(out, "{:<12} none yet", "answer");
        }
    }
    out
}

/// A recorded answer as JSON: a response the tower layer recorded as HTTP (status, headers as
/// text, body), any other answer as it was recorded.
fn answer_payload(payload: &[u8]) -> Value {
    let answer = json_payload(payload);
    http_answer(&answer).unwrap_or(answer)
}

/// A response the tower layer recorded, as HTTP: the status line, headers, a blank line and
/// the body (pretty JSON, or text).
fn http_text(http: &Value) -> String {
    let mut out = format!(
        "{:<12} HTTP {} (a response the tower layer recorded, replayed to every retry)\n",
        "answer", http["status"]
    );
    if let Some(headers) = http["headers"].as_object() {
        for (name, value) in headers {
            let values = match value {
                Value::Array(values) => values.iter().filter_map(Value::as_str).collect(),
                value => vec![value.as_str().unwrap_or_default()],
            };
            for value in values {
                let _ = writeln!(out, "  {name}: {value}");
            }
        }
    }
    out.push('\n');
    match &http["body"] {
        Value::String(text) => {
            for line in text.lines() {
                let _ = writeln!(out, "  {line}");
            }
        }
        body => out.push_str(&indented_json(body, 2)),
    }
    out
}

/// `idem list`: a scope's recent records, newest first.
pub(crate) async fn list(
    db: &DatabaseConnection,
    scope: &str,
    since: Duration,
    state: Option<RecordStatus>,
    limit: u32,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[LEDGER_TABLE]).await?;
    let records = idem_sea_orm::inspect::recent_records(db, scope, since, state, limit).await?;
    if json {
        let records: Vec<Value> = records
            .iter()
            .map(|view| {
                json!({
                    "id": hex(&view.record.id),
                    "principal": view.record.principal,
                    "key": view.record.idem_key,
                    "state": state_name(view),
                    "state_code": view.record.state,
                    "created_at": iso8601(view.record.created_at_ms),
                    "created_at_ms": view.record.created_at_ms,
                    "expires_at": iso8601(view.record.expires_at_ms),
                    "expires_at_ms": view.record.expires_at_ms,
                })
            })
            .collect();
        print_json(&Value::Array(records))?;
        return Ok(Found::Yes);
    }
    let since = span(u64::try_from(since.as_millis()).unwrap_or(u64::MAX));
    if records.is_empty() {
        print(&format!(
            "no records of {scope} claimed in the last {since}\n"
        ))?;
        return Ok(Found::Yes);
    }
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|view| {
            vec![
                format!(
                    "{} ago",
                    span(
                        view.now_ms
                            .saturating_sub(view.record.created_at_ms)
                            .unsigned_abs()
                    )
                ),
                state_name(view),
                view.record.idem_key.clone(),
                view.record.principal.clone(),
                hex(&view.record.id),
            ]
        })
        .collect();
    let mut out = format!(
        "{} record{} of {scope} claimed in the last {since} (newest first; `idem inspect --id` \
        shows one):\n",
        records.len(),
        if records.len() == 1 { "" } else { "s" }
    );
    out.push_str(&table(
        &["CLAIMED", "STATE", "KEY", "PRINCIPAL", "RECORD"],
        &rows,
    ));
    if records.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}; --limit shows more)");
    }
    print(&out)?;
    Ok(Found::Yes)
}

/// `idem leases`: leases that ended without their call finishing, and live leases held for
/// longer than `stuck_after`.
pub(crate) async fn leases(
    db: &DatabaseConnection,
    limit: u32,
    stuck_after: Duration,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[LEDGER_TABLE]).await?;
    let leases = idem_sea_orm::expired_leases(db, limit).await?;
    let stuck = idem_sea_orm::stuck_leases(db, stuck_after, limit).await?;
    let finisher = |resumable: bool| {
        if resumable {
            "completer or client retry"
        } else {
            "client retry only"
        }
    };
    if json {
        let leases: Vec<Value> = leases
            .iter()
            .map(|lease| {
                json!({
                    "id": hex(&lease.id),
                    "scope": lease.scope,
                    "key": lease.key,
                    "token": lease.token,
                    "ended_ms_ago": lease.ended_ms_ago,
                    "resumable": lease.resumable,
                    "attempts": lease.attempts,
                    "finished_by": finisher(lease.resumable),
                    "stuck": false,
                })
            })
            .chain(stuck.iter().map(|lease| {
                json!({
                    "id": hex(&lease.id),
                    "scope": lease.scope,
                    "key": lease.key,
                    "token": lease.token,
                    "held_ms": lease.held_ms,
                    "ends_in_ms": lease.ends_in_ms,
                    "resumable": lease.resumable,
                    "stuck": true,
                })
            }))
            .collect();
        print_json(&Value::Array(leases))?;
        return Ok(Found::Yes);
    }
    let stuck_text = stuck_text(&stuck, stuck_after, limit);
    if leases.is_empty() {
        print(&format!(
            "no leases ended without their call finishing\n{stuck_text}"
        ))?;
        return Ok(Found::Yes);
    }
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|lease| {
            vec![
                format!("{} ago", span(lease.ended_ms_ago.unsigned_abs())),
                lease.scope.clone(),
                lease.key.clone(),
                lease.token.to_string(),
                if lease.resumable {
                    format!("{} ({} attempts)", finisher(true), lease.attempts)
                } else {
                    finisher(false).to_owned()
                },
                hex(&lease.id),
            ]
        })
        .collect();
    let mut out = format!(
        "{} lease{} ended without the call finishing (oldest first; a completer finishes a \
        resumable call only where one runs with a resumer for its scope):\n",
        leases.len(),
        if leases.len() == 1 { "" } else { "s" }
    );
    out.push_str(&table(
        &["ENDED", "SCOPE", "KEY", "TOKEN", "FINISHED BY", "RECORD"],
        &rows,
    ));
    if leases.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}; --limit shows more)");
    }
    out.push_str(&stuck_text);
    print(&out)?;
    Ok(Found::Yes)
}

/// The stuck leases' part of `idem leases` (empty when there are none).
fn stuck_text(stuck: &[idem_sea_orm::StuckLease], stuck_after: Duration, limit: u32) -> String {
    if stuck.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = stuck
        .iter()
        .map(|lease| {
            vec![
                span(lease.held_ms.unsigned_abs()),
                span(lease.ends_in_ms.unsigned_abs()),
                lease.scope.clone(),
                lease.key.clone(),
                lease.token.to_string(),
                hex(&lease.id),
            ]
        })
        .collect();
    let mut out = format!(
        "{} live lease{} held for longer than {} (a hung holder keeps renewing; `idem release \
        --id RECORD` ends one, fenced, and the next retry or completer takes over):\n",
        stuck.len(),
        if stuck.len() == 1 { "" } else { "s" },
        span(u64::try_from(stuck_after.as_millis()).unwrap_or(u64::MAX)),
    );
    out.push_str(&table(
        &["HELD", "ENDS IN", "SCOPE", "KEY", "TOKEN", "RECORD"],
        &rows,
    ));
    if stuck.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}; --limit shows more)");
    }
    out
}

/// `idem release`: ends the lease of the call in progress under `id`, fenced.
pub(crate) async fn release(
    db: &DatabaseConnection,
    args: &InspectArgs,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[LEDGER_TABLE]).await?;
    let (id, _) = resolve(db, args).await?;
    let id = id.as_slice();
    let released = !id.is_empty() && idem_sea_orm::release_lease(db, id).await?;
    if json {
        print_json(&json!({ "released": released, "id": hex(id) }))?;
    } else if released {
        print(&format!(
            "released the lease of {}: its holder is refused its next step; the next retry, or a \
            completer for a resumable call, takes over from the recorded steps\n",
            hex(id)
        ))?;
    } else {
        eprintln!(
            "no live lease under record {}: nothing to release (`idem inspect --id` shows the \
            record, if any; a lease that ended is taken over by the next retry anyway)",
            hex(id)
        );
    }
    Ok(if released { Found::Yes } else { Found::No })
}

/// `idem outbox`: pending, oldest pending, dead.
pub(crate) async fn outbox_health(db: &DatabaseConnection, json: bool) -> Result<Found, Failure> {
    require_tables(db, &[OUTBOX_TABLE]).await?;
    let health = idem_sea_orm::outbox_health(db).await?;
    if json {
        print_json(&json!({
            "pending": health.pending,
            "oldest_pending_ms": health.oldest_pending_ms,
            "dead": health.dead,
        }))?;
        return Ok(Found::Yes);
    }
    let oldest = health
        .oldest_pending_ms
        .map(|ms| format!(" (oldest staged {} ago)", span(ms)))
        .unwrap_or_default();
    let dead_hint = if health.dead > 0 {
        " (`idem outbox dead` lists them; each blocks its aggregate)"
    } else {
        ""
    };
    print(&format!(
        "pending  {}{oldest}\ndead     {}{dead_hint}\n",
        health.pending, health.dead
    ))?;
    Ok(Found::Yes)
}

/// `idem outbox dead`: dead messages with their last error.
pub(crate) async fn outbox_dead(
    db: &DatabaseConnection,
    limit: u32,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[OUTBOX_TABLE]).await?;
    let dead = idem_sea_orm::dead_messages(db, limit).await?;
    if json {
        let dead: Vec<Value> = dead
            .iter()
            .map(|message| {
                json!({
                    "id": message.id,
                    "topic": message.topic,
                    "aggregate": message.aggregate,
                    "aggregate_seq": message.aggregate_seq,
                    "attempts": message.attempts,
                    "last_error": message.last_error,
                    "staged_at": iso8601(message.created_at_ms),
                })
            })
            .collect();
        print_json(&Value::Array(dead))?;
        return Ok(Found::Yes);
    }
    if dead.is_empty() {
        print("no dead messages\n")?;
        return Ok(Found::Yes);
    }
    let now = idem_sea_orm::database_now_ms(db).await?;
    let rows: Vec<Vec<String>> = dead
        .iter()
        .map(|message| {
            vec![
                message.id.clone(),
                message.topic.clone(),
                match (&message.aggregate, message.aggregate_seq) {
                    (Some(aggregate), Some(seq)) => format!("{aggregate} #{seq}"),
                    (Some(aggregate), None) => aggregate.clone(),
                    _ => "-".to_owned(),
                },
                message.attempts.to_string(),
                relative(message.created_at_ms, now),
                message
                    .last_error
                    .as_deref()
                    .map_or_else(|| "-".to_owned(), one_line),
            ]
        })
        .collect();
    let mut out = table(
        &[
            "ID",
            "TOPIC",
            "AGGREGATE",
            "ATTEMPTS",
            "STAGED",
            "LAST ERROR",
        ],
        &rows,
    );
    if dead.len() == limit as usize {
        let _ = writeln!(out, "(the first {limit}; --limit shows more)");
    }
    print(&out)?;
    Ok(Found::Yes)
}

/// `idem outbox retry ID` / `--all-dead`: dead messages back in line.
pub(crate) async fn outbox_retry(
    db: &DatabaseConnection,
    id: Option<&str>,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[OUTBOX_TABLE]).await?;
    let Some(id) = id else {
        let retried = retry_all_dead(db).await?;
        if json {
            print_json(&json!({ "retried": retried }))?;
        } else {
            print(&format!(
                "{} dead message{} back in line with fresh attempts\n",
                retried.len(),
                if retried.len() == 1 { "" } else { "s" }
            ))?;
        }
        return Ok(Found::Yes);
    };
    let retried = idem_sea_orm::retry_dead(db, id).await?;
    if json {
        print_json(&json!({ "retried": if retried { vec![id] } else { Vec::new() } }))?;
    } else if retried {
        print(&format!(
            "{id} is back in line with fresh attempts; a relay publishes it next\n"
        ))?;
    } else {
        eprintln!("no dead message has id {id} (`idem outbox dead` lists them)");
    }
    Ok(if retried { Found::Yes } else { Found::No })
}

/// Retries every dead message, a page at a time, and returns their ids. A message seen twice
/// died again while this ran: it is not retried again, so the loop ends.
async fn retry_all_dead(db: &DatabaseConnection) -> Result<Vec<String>, Failure> {
    const PAGE: u32 = 500;
    let mut retried: Vec<String> = Vec::new();
    loop {
        let page = idem_sea_orm::dead_messages(db, PAGE).await?;
        let fresh: Vec<_> = page
            .into_iter()
            .filter(|message| !retried.contains(&message.id))
            .collect();
        if fresh.is_empty() {
            return Ok(retried);
        }
        for message in fresh {
            if idem_sea_orm::retry_dead(db, &message.id).await? {
                retried.push(message.id);
            }
        }
    }
}

/// `idem outbox purge --older-than D`: published messages past their retention.
pub(crate) async fn outbox_purge(
    db: &DatabaseConnection,
    older_than: Duration,
    batch: u32,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[OUTBOX_TABLE]).await?;
    let deleted = idem_sea_orm::purge_published(db, older_than, batch).await?;
    if json {
        print_json(&json!({ "deleted": deleted }))?;
    } else {
        print(&format!(
            "deleted {deleted} message{} published more than {} ago\n",
            if deleted == 1 { "" } else { "s" },
            span(u64::try_from(older_than.as_millis()).unwrap_or(u64::MAX))
        ))?;
    }
    Ok(Found::Yes)
}

/// How often `idem purge` reports its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// `idem purge`: records that ended and whose TTL passed, one bounded statement at a time,
/// with progress on stderr. Calls not finished are kept however old (`idem leases`).
pub(crate) async fn purge(
    db: &DatabaseConnection,
    batch: u32,
    json: bool,
) -> Result<Found, Failure> {
    require_tables(db, &[LEDGER_TABLE]).await?;
    let started = Instant::now();
    // The operator's purge also sweeps steps and calls left without their record (rows
    // deleted by hand): a read of the whole ledger, which a periodic purge leaves out.
    let mut purge = idem_sea_orm::ExpiredPurge::new().with_orphans();
    let mut statements = 0u64;
    let mut reported = Instant::now();
    while !purge.is_finished() {
        let statement_started = Instant::now();
        purge.step(db, batch).await?;
        statements += 1;
        if !json && reported.elapsed() >= PROGRESS_EVERY {
            eprintln!(
                "purged {} ended records so far ({statements} statements)",
                purge.deleted()
            );
            reported = Instant::now();
        }
        // As `purge_expired` does: pause as long as the statement took, so the purge holds
        // at most half of the database's write time and claims queue behind one batch at most.
        if !purge.is_finished() {
            tokio::time::sleep(statement_started.elapsed()).await;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if json {
        print_json(&json!({
            "deleted": purge.deleted(),
            "statements": statements,
            "seconds": (seconds * 1000.0).round() / 1000.0,
        }))?;
    } else {
        print(&format!(
            "purged {} ended record{} in {statements} statement{} ({seconds:.1}s); calls not \
            finished are kept however old: `idem leases` lists them\n",
            purge.deleted(),
            if purge.deleted() == 1 { "" } else { "s" },
            if statements == 1 { "" } else { "s" },
        ))?;
    }
    Ok(Found::Yes)
}
