//! `idem`: the operator's command for a service that uses idem. It answers "was this payment
//! run twice?" from the ledger (`idem inspect`, by key or by the `key_hash` of a log line),
//! lists a scope's recent records (`idem list`) and leases that ended without their call
//! finishing (`idem leases`), shows the outbox (`idem outbox`), and, only when asked, retries
//! dead messages and purges. SQLite, PostgreSQL and MariaDB, through `idem-sea-orm`.

mod commands;
mod database;
mod format;

use std::io::Write as _;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use idem_sea_orm::inspect::IdPrefix;

/// Exit codes, as `--help` documents them.
const EXIT_OK: u8 = 0;
const EXIT_NOT_FOUND: u8 = 1;
const EXIT_ERROR: u8 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Inspect and operate the idem ledger, leases and outbox of a service",
    long_about = "Inspect and operate the idem ledger, leases and outbox of a service.\n\n\
        Read-only unless asked: only `outbox retry`, `outbox purge`, `purge` and `release` write. \
        Times are the database's clock, shown in UTC and relative to the database's now.",
    after_help = "Exit codes:\n  \
        0  ok\n  \
        1  not found (`inspect` of an unknown record, `outbox retry` of an id that is not dead)\n  \
        2  error (bad arguments or URL, unreachable database, missing idem tables, an id \
        prefix several records share)\n\n\
        Database: --url or DATABASE_URL, e.g. postgres://user@host/db, \
        mysql://user@host/db (MariaDB), sqlite://path/to/file.db"
)]
struct Cli {
    /// The service's database (postgres://…, mysql://… for MariaDB, sqlite://…)
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    url: Option<String>,

    /// Print JSON for scripts instead of tables
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show one record: its state, answer, lease, recorded steps and stored call
    Inspect(InspectArgs),
    /// List a scope's recent records, newest first (reads the whole ledger table)
    List {
        /// The handler's scope, e.g. shop.orders.pay
        #[arg(long)]
        scope: String,
        /// Only records claimed this long ago or less: a number and a unit (ms, s, m, h, d)
        #[arg(long, default_value = "1d", value_parser = format::parse_duration)]
        since: std::time::Duration,
        /// Only records in this state
        #[arg(long, value_enum)]
        state: Option<StateFilter>,
        /// Show at most this many
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
    },
    /// List leases that ended without their call finishing, and who can finish each; and live
    /// leases held for longer than --stuck-after (a hung holder: `idem release` ends one)
    Leases {
        /// Show at most this many of each, oldest first
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// A live lease held (since its claim or takeover) for longer than this is listed as
        /// stuck: a number and a unit (ms, s, m, h, d)
        #[arg(long, default_value = "10m", value_parser = format::parse_duration)]
        stuck_after: std::time::Duration,
    },
    /// End a call's lease by hand, fenced: its token goes up by one (the holder's next step is
    /// refused) and the lease ends now (the next retry, or a completer, takes over from the
    /// recorded steps)
    Release(InspectArgs),
    /// Show the outbox's health (pending, oldest pending, dead), or act on it
    Outbox {
        #[command(subcommand)]
        action: Option<OutboxAction>,
    },
    /// Print the DDL of idem's tables for a backend, as a migration file for the service's
    /// own migrations (`sqlx migrate`, refinery, Flyway, …); needs no database
    Schema {
        /// The database the DDL is for
        #[arg(long, value_enum)]
        backend: SchemaBackend,
        /// Only these families of tables, comma-separated: ledger (every call; atomic mode needs
        /// nothing else), lease (lease mode's steps), completer (resumable calls), outbox
        /// (the outbox and the inbox's dead letters)
        #[arg(long, value_delimiter = ',', value_parser = parse_family)]
        only: Vec<idem_sea_orm::Family>,
    },
    /// Delete records that ended (completed, failed, given up with no hook owed) and whose
    /// TTL passed, batch by batch; calls not finished are kept however old
    Purge {
        /// Records per statement; each statement is a short transaction of its own
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
    },
}

/// The databases `idem schema` writes DDL for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum SchemaBackend {
    Postgres,
    /// MariaDB and MySQL
    Mysql,
    Sqlite,
}

fn parse_family(name: &str) -> Result<idem_sea_orm::Family, String> {
    idem_sea_orm::Family::named(name).ok_or_else(|| {
        format!("`{name}` is not a family of idem's tables: ledger, lease, completer or outbox")
    })
}

#[derive(Debug, Args)]
struct InspectArgs {
    /// The handler's scope, e.g. shop.orders.pay
    #[arg(long, required_unless_present = "id", requires = "key")]
    scope: Option<String>,
    /// The idempotency key, bare or as the client's Idempotency-Key header carried it
    /// (a quoted structured-field string: "k-1")
    #[arg(long, required_unless_present = "id", requires = "scope")]
    key: Option<String>,
    /// The principal the key belongs to, if the handler declares one
    #[arg(long, default_value = "", requires = "scope")]
    principal: String,
    /// The record id instead, or any unique start of it: the `key_hash` of a log line
    /// (16 hex digits), or the 64 that `idem leases` and `idem list` print
    #[arg(long, value_parser = IdPrefix::parse, conflicts_with_all = ["scope", "key"])]
    id: Option<IdPrefix>,
}

/// The states `idem list --state` filters on.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum StateFilter {
    /// Claimed and not finished (lease mode)
    InProgress,
    /// Answered with a value
    Completed,
    /// Answered with a final error
    Failed,
    /// Given up by a completer
    GaveUp,
}

impl StateFilter {
    fn status(self) -> idem_core::RecordStatus {
        use idem_core::RecordStatus;
        match self {
            Self::InProgress => RecordStatus::Pending,
            Self::Completed => RecordStatus::Completed,
            Self::Failed => RecordStatus::Failed,
            Self::GaveUp => RecordStatus::GaveUp,
        }
    }
}

#[derive(Debug, Subcommand)]
enum OutboxAction {
    /// List dead messages (they block their aggregate) with their last error
    Dead {
        /// Show at most this many, oldest first
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Put a dead message (or every one) back in line with fresh attempts
    Retry {
        /// The message id (`idem outbox dead` lists them)
        #[arg(required_unless_present = "all_dead", conflicts_with = "all_dead")]
        id: Option<String>,
        /// Retry every dead message
        #[arg(long)]
        all_dead: bool,
    },
    /// Delete messages published longer ago than a retention
    Purge {
        /// The retention: a number and a unit (ms, s, m, h, d), e.g. 7d
        #[arg(long, value_parser = format::parse_duration)]
        older_than: std::time::Duration,
        /// Messages per statement
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..))]
        batch: u32,
    },
}

/// How a command that ran ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Yes,
    No,
}

/// Why a command could not run: printed as one line, exit code 2.
#[derive(Debug)]
struct Failure(String);

impl Failure {
    /// `what` went wrong, with the chain of errors behind it on the same line.
    fn caused(what: &str, error: &(dyn std::error::Error + 'static)) -> Self {
        Self(format!("{what}: {}", describe(error)))
    }
}

impl From<idem_core::Error> for Failure {
    fn from(error: idem_core::Error) -> Self {
        match &error {
            // The store's message already says what it was doing; "idempotency store
            // failed" is how a handler's caller hears of it, not an operator.
            idem_core::Error::Store { message, source } => Self(match source {
                Some(source) => format!("{message}: {}", describe(source.as_ref())),
                None => message.clone(),
            }),
            _ => Self(describe(&error)),
        }
    }
}

/// An error and its sources on one line, each source once (drivers often repeat their
/// source's text in their own).
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = format::one_line(&error.to_string());
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = format::one_line(&cause.to_string());
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// Writes `text` to stdout. A reader that went away (`idem leases | head`) is not an error.
fn print(text: &str) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(Failure::caused("writing the output", &e))
        }
        _ => Ok(()),
    }
}

/// A JSON document on stdout, one line, for scripts.
fn print_json(value: &serde_json::Value) -> Result<(), Failure> {
    print(&format!("{value}\n"))
}

/// `idem schema`: the DDL of the families asked for (all by default), in creation order.
fn print_schema(backend: SchemaBackend, only: &[idem_sea_orm::Family]) -> Result<Found, Failure> {
    use idem_sea_orm::sea_orm::DbBackend;
    let backend = match backend {
        SchemaBackend::Postgres => DbBackend::Postgres,
        SchemaBackend::Mysql => DbBackend::MySql,
        SchemaBackend::Sqlite => DbBackend::Sqlite,
    };
    let files: Vec<String> = idem_sea_orm::Family::ALL
        .into_iter()
        .filter(|family| only.is_empty() || only.contains(family))
        .map(|family| idem_sea_orm::schema(backend, family))
        .collect();
    print(&files.join("\n"))?;
    Ok(Found::Yes)
}

/// Runs the command `cli` names; every one but `schema` on the database `--url` names.
async fn run(cli: Cli) -> Result<Found, Failure> {
    // The one command that needs no database.
    if let Command::Schema { backend, only } = &cli.command {
        return print_schema(*backend, only);
    }
    let url = cli.url.as_deref().ok_or_else(|| {
        Failure("no database: set DATABASE_URL or pass --url (see `idem --help`)".to_owned())
    })?;
    let db = database::connect(url).await?;
    let json = cli.json;
    let found = match cli.command {
        Command::Inspect(args) => commands::inspect(&db, &args, json).await?,
        Command::List {
            scope,
            since,
            state,
            limit,
        } => {
            let state = state.map(StateFilter::status);
            commands::list(&db, &scope, since, state, limit, json).await?
        }
        Command::Release(args) => commands::release(&db, &args, json).await?,
        Command::Leases { limit, stuck_after } => {
            commands::leases(&db, limit, stuck_after, json).await?
        }
        Command::Outbox { action } => match action {
            None => commands::outbox_health(&db, json).await?,
            Some(OutboxAction::Dead { limit }) => commands::outbox_dead(&db, limit, json).await?,
            Some(OutboxAction::Retry { id, .. }) => {
                commands::outbox_retry(&db, id.as_deref(), json).await?
            }
            Some(OutboxAction::Purge { older_than, batch }) => {
                commands::outbox_purge(&db, older_than, batch, json).await?
            }
        },
        Command::Purge { batch } => commands::purge(&db, batch, json).await?,
        Command::Schema { backend, only } => print_schema(backend, &only)?,
    };
    let _ = db.close().await;
    Ok(found)
}

fn main() -> ExitCode {
    // Usage errors exit with 2 and `--help` with 0, from clap itself.
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: {}", Failure::caused("starting the runtime", &e).0);
            return ExitCode::from(EXIT_ERROR);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(Found::Yes) => ExitCode::from(EXIT_OK),
        Ok(Found::No) => ExitCode::from(EXIT_NOT_FOUND),
        Err(Failure(message)) => {
            eprintln!("error: {message}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}
