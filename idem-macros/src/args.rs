//! The `#[idempotent(...)]` argument model and its parser.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitStr, Path, Token};

/// The lease of `lease` without a value.
const DEFAULT_LEASE_MS: u64 = 30_000;

/// Every argument name, in the order the docs list them.
const ARGUMENTS: &[&str] = &[
    "scope",
    "key",
    "principal",
    "skip",
    "ttl",
    "on_concurrent",
    "lease",
    "conn",
    "crate",
];

/// Names people reach for, and the argument they mean.
const RENAMES: &[(&str, &str)] = &[
    ("name", "scope"),
    ("operation", "scope"),
    ("idempotency_key", "key"),
    ("tenant", "principal"),
    ("user", "principal"),
    ("exclude", "skip"),
    ("ignore", "skip"),
    ("expiry", "ttl"),
    ("expires", "ttl"),
    ("concurrency", "on_concurrent"),
    ("on_conflict", "on_concurrent"),
    ("db", "conn"),
    ("store", "conn"),
    ("connection", "conn"),
    ("krate", "crate"),
    ("mode", "lease"),
    ("lease_ms", "lease"),
];

/// The parsed, validated attribute arguments.
pub(crate) struct Args {
    pub(crate) scope: LitStr,
    pub(crate) key: Expr,
    pub(crate) principal: Option<Expr>,
    pub(crate) skip: Vec<Ident>,
    pub(crate) ttl_ms: u64,
    pub(crate) policy: Policy,
    /// `lease` / `lease = "30s"`: lease mode, with this lease in milliseconds.
    pub(crate) lease_ms: Option<u64>,
    pub(crate) conn: Option<Conn>,
    pub(crate) krate: Option<Path>,
}

/// `on_concurrent = wait`, `wait("2s")` or `reject`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Wait for the other call, at most `bound_ms` (the engine's default when `None`).
    Wait { bound_ms: Option<u64> },
    /// Fail fast with `InFlight`.
    Reject,
}

/// Where the connection comes from and the name the body sees the transaction under.
pub(crate) enum Conn {
    /// `conn = db`: a parameter, rebound to the transaction inside the body.
    Param(Ident),
    /// `conn = self.db as db`: any expression, with the body's name for the transaction.
    Expr { expr: Expr, binding: Ident },
}

/// Parses into `Args`, collecting every error instead of stopping at the first.
pub(crate) struct RawArgs {
    pub(crate) args: Option<Args>,
    pub(crate) errors: Option<syn::Error>,
}

fn push(errors: &mut Option<syn::Error>, e: syn::Error) {
    match errors {
        Some(all) => all.combine(e),
        None => *errors = Some(e),
    }
}

/// Parses a duration such as `24h`, `90s`, `1h30m` or `500ms` into milliseconds.
fn parse_ttl(text: &str) -> Result<u64, String> {
    parse_duration(
        text,
        "ttl",
        "a record that expires at once deduplicates nothing",
    )
}

/// Parses a duration such as `24h`, `90s`, `1h30m` or `500ms` into milliseconds; `what` names
/// the argument in messages, `zero` says why zero is refused.
fn parse_duration(text: &str, what: &str, zero: &str) -> Result<u64, String> {
    let hint = "write it as a number and a unit: `30s`, `15m`, `24h`, `7d` or `1h30m`";
    if text.is_empty() {
        return Err(format!("empty `{what}`; {hint}"));
    }
    let mut total: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return Err(format!("invalid `{what}` \"{text}\"; {hint}"));
        }
        let number: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("`{what}` \"{text}\" is too large"))?;
        rest = &rest[digits..];
        let (unit_ms, len) = if rest.starts_with("ms") {
            (1, 2)
        } else {
            match rest.chars().next() {
                Some('s') => (1_000, 1),
                Some('m') => (60_000, 1),
                Some('h') => (3_600_000, 1),
                Some('d') => (86_400_000, 1),
                _ => return Err(format!("invalid `{what}` \"{text}\": missing unit; {hint}")),
            }
        };
        rest = &rest[len..];
        total = number
            .checked_mul(unit_ms)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("`{what}` \"{text}\" is too large"))?;
    }
    if total == 0 {
        return Err(format!("`{what}` must be longer than zero: {zero}; {hint}"));
    }
    Ok(total)
}

fn check_scope(scope: &LitStr) -> Result<(), syn::Error> {
    let value = scope.value();
    let problem = if value.is_empty() {
        Some("`scope` must not be empty; name the operation, e.g. \"orders.pay\"")
    } else if value.len() > 255 {
        Some("`scope` must be at most 255 bytes")
    } else if value.chars().any(char::is_control) {
        Some("`scope` must not contain control characters")
    } else {
        None
    };
    problem.map_or(Ok(()), |p| Err(syn::Error::new(scope.span(), p)))
}

impl Parse for RawArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut errors = None;
        let mut scope: Option<LitStr> = None;
        let mut key: Option<Expr> = None;
        let mut principal: Option<Expr> = None;
        let mut skip: Option<Vec<Ident>> = None;
        let mut ttl_ms: Option<u64> = None;
        let mut ttl_seen = false;
        let mut policy: Option<Policy> = None;
        let mut policy_seen = false;
        // Where a bare `wait` was written (lease mode refuses it there).
        let mut bare_wait: Option<Span> = None;
        let mut lease_ms: Option<u64> = None;
        let mut lease_seen = false;
        let mut conn: Option<Conn> = None;
        let mut krate: Option<Path> = None;

        while !input.is_empty() {
            let name: Ident = if input.peek(Token![crate]) {
                let token: Token![crate] = input.parse()?;
                Ident::new("crate", token.span)
            } else {
                input.parse()?
            };
            let label = name.to_string();
            let duplicate = |present: bool, errors: &mut Option<syn::Error>| {
                if present {
                    push(
                        errors,
                        syn::Error::new(
                            name.span(),
                            format!("duplicate argument `{label}`; give it once"),
                        ),
                    );
                }
            };
            match label.as_str() {
                "scope" => {
                    input.parse::<Token![=]>()?;
                    let lit: LitStr = input.parse().map_err(|e| {
                        syn::Error::new(
                            e.span(),
                            "`scope` takes a string literal, e.g. `scope = \"orders.pay\"`",
                        )
                    })?;
                    duplicate(scope.is_some(), &mut errors);
                    if let Err(e) = check_scope(&lit) {
                        push(&mut errors, e);
                    }
                    scope = Some(lit);
                }
                "key" | "principal" => {
                    input.parse::<Token![=]>()?;
                    let expr: Expr = input.parse()?;
                    let slot = if label == "key" {
                        &mut key
                    } else {
                        &mut principal
                    };
                    duplicate(slot.is_some(), &mut errors);
                    *slot = Some(expr);
                }
                "skip" => {
                    let content;
                    syn::parenthesized!(content in input);
                    let names = content.parse_terminated(Ident::parse, Token![,])?;
                    duplicate(skip.is_some(), &mut errors);
                    skip = Some(names.into_iter().collect());
                }
                "ttl" => {
                    input.parse::<Token![=]>()?;
                    let lit: LitStr = input.parse().map_err(|e| {
                        syn::Error::new(
                            e.span(),
                            "`ttl` takes a string literal, e.g. `ttl = \"24h\"`",
                        )
                    })?;
                    duplicate(ttl_seen, &mut errors);
                    ttl_seen = true;
                    match parse_ttl(&lit.value()) {
                        Ok(ms) => ttl_ms = Some(ms),
                        Err(message) => push(&mut errors, syn::Error::new(lit.span(), message)),
                    }
                }
                "on_concurrent" => {
                    input.parse::<Token![=]>()?;
                    let name: Ident = input.parse()?;
                    duplicate(policy_seen, &mut errors);
                    policy_seen = true;
                    match name.to_string().as_str() {
                        "wait" if input.peek(syn::token::Paren) => {
                            let content;
                            syn::parenthesized!(content in input);
                            let lit: LitStr = content.parse().map_err(|e| {
                                syn::Error::new(
                                    e.span(),
                                    "`wait(..)` takes the longest wait as a string, e.g. `wait(\"2s\")`",
                                )
                            })?;
                            match parse_duration(
                                &lit.value(),
                                "wait",
                                "a duplicate would never wait; use `reject` to fail fast",
                            ) {
                                Ok(ms) => policy = Some(Policy::Wait { bound_ms: Some(ms) }),
                                Err(m) => push(&mut errors, syn::Error::new(lit.span(), m)),
                            }
                        }
                        "wait" => {
                            bare_wait = Some(name.span());
                            policy = Some(Policy::Wait { bound_ms: None });
                        }
                        "reject" => policy = Some(Policy::Reject),
                        other => push(
                            &mut errors,
                            syn::Error::new(
                                name.span(),
                                format!(
                                    "unknown policy `{other}`; expected `wait` (replay once the other call finishes; `wait(\"2s\")` bounds the wait) or `reject` (fail with `InFlight`)"
                                ),
                            ),
                        ),
                    }
                }
                "lease" => {
                    duplicate(lease_seen, &mut errors);
                    lease_seen = true;
                    if input.peek(Token![=]) {
                        input.parse::<Token![=]>()?;
                        let lit: LitStr = input.parse().map_err(|e| {
                            syn::Error::new(
                                e.span(),
                                "`lease` takes a duration string, e.g. `lease = \"30s\"` (or `lease` alone for 30 s)",
                            )
                        })?;
                        match parse_duration(
                            &lit.value(),
                            "lease",
                            "a zero lease ends before the body starts; give the longest the body may take, e.g. `lease = \"30s\"`",
                        ) {
                            Ok(ms) => lease_ms = Some(ms),
                            Err(m) => push(&mut errors, syn::Error::new(lit.span(), m)),
                        }
                    } else {
                        lease_ms = Some(DEFAULT_LEASE_MS);
                    }
                }
                "conn" => {
                    input.parse::<Token![=]>()?;
                    let expr: Expr = input.parse()?;
                    duplicate(conn.is_some(), &mut errors);
                    match conn_from(expr) {
                        Ok(c) => conn = Some(c),
                        Err(e) => push(&mut errors, e),
                    }
                }
                "crate" => {
                    input.parse::<Token![=]>()?;
                    let lit: LitStr = input.parse()?;
                    duplicate(krate.is_some(), &mut errors);
                    match lit.parse::<Path>() {
                        Ok(path) => krate = Some(path),
                        Err(_) => push(
                            &mut errors,
                            syn::Error::new(
                                lit.span(),
                                format!(
                                    "`crate` must be a path such as \"::my_app::idem\", not \"{}\"",
                                    lit.value()
                                ),
                            ),
                        ),
                    }
                }
                _ => {
                    let hint = RENAMES
                        .iter()
                        .find(|(from, _)| *from == label)
                        .map(|(_, to)| *to)
                        .or_else(|| {
                            ARGUMENTS
                                .iter()
                                .copied()
                                .find(|a| edit_distance(a, &label) <= 2)
                        })
                        .map(|to| format!(" (did you mean `{to}`?)"))
                        .unwrap_or_default();
                    let all = ARGUMENTS
                        .iter()
                        .map(|a| format!("`{a}`"))
                        .collect::<Vec<_>>()
                        .join(", ");
                    push(
                        &mut errors,
                        syn::Error::new(
                            name.span(),
                            format!("unknown argument `{label}`{hint}; expected one of {all}"),
                        ),
                    );
                    // Skip the unknown argument's value so the rest still parses.
                    while !input.is_empty() && !input.peek(Token![,]) {
                        input.parse::<proc_macro2::TokenTree>()?;
                    }
                }
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }

        let example = "#[idempotent(scope = \"orders.pay\", key = cmd.idempotency_key)]";
        if scope.is_none() {
            push(
                &mut errors,
                syn::Error::new(
                    Span::call_site(),
                    format!("missing `scope`: name the operation, e.g. `{example}`"),
                ),
            );
        }
        if key.is_none() {
            push(
                &mut errors,
                syn::Error::new(
                    Span::call_site(),
                    format!(
                        "missing `key`: say where the idempotency key comes from, e.g. `{example}`"
                    ),
                ),
            );
        }
        if let (true, Some(span)) = (lease_seen, bare_wait) {
            push(
                &mut errors,
                syn::Error::new(
                    span,
                    "in lease mode a duplicate cannot wait on the claim's lock (the claim has committed); \
                     use `reject` (the default: `InFlight` with Retry-After until the lease ends) or \
                     bound the wait, e.g. `wait(\"2s\")`, to poll for the recorded result",
                ),
            );
        }
        // A missing `scope` or `key` is already an error, so the expansion is discarded; the
        // placeholders only let the signature checks run, and their errors join these.
        let args = Some(Args {
            scope: scope.unwrap_or_else(|| LitStr::new("", Span::call_site())),
            key: key.unwrap_or_else(|| syn::parse_quote!(())),
            principal,
            skip: skip.unwrap_or_default(),
            ttl_ms: ttl_ms.unwrap_or(24 * 3_600_000),
            // Lease mode answers a duplicate at once by default: its claim is no lock to wait on.
            policy: policy.unwrap_or(if lease_seen {
                Policy::Reject
            } else {
                Policy::Wait { bound_ms: None }
            }),
            lease_ms,
            conn,
            krate,
        });
        Ok(Self { args, errors })
    }
}

/// Levenshtein distance, for "did you mean" hints on misspelt arguments.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

fn conn_from(expr: Expr) -> syn::Result<Conn> {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
            let ident = p.path.get_ident().cloned();
            Ok(Conn::Param(
                ident.unwrap_or_else(|| Ident::new("db", p.span())),
            ))
        }
        Expr::Cast(cast) => match &*cast.ty {
            syn::Type::Path(t) if t.qself.is_none() && t.path.get_ident().is_some() => {
                let binding = t
                    .path
                    .get_ident()
                    .cloned()
                    .unwrap_or_else(|| Ident::new("db", t.span()));
                Ok(Conn::Expr {
                    expr: *cast.expr,
                    binding,
                })
            }
            other => Err(syn::Error::new(
                other.span(),
                "after `as`, name the transaction the body uses, e.g. `conn = self.db as db`",
            )),
        },
        other => Err(syn::Error::new(
            other.span(),
            "name the transaction the body uses: `conn = self.db as db` (or `conn = <parameter>`)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: proc_macro2::TokenStream) -> RawArgs {
        syn::parse2(tokens).expect("parses")
    }

    #[test]
    fn parses_every_argument() {
        let raw = parse(quote::quote!(
            scope = "orders.pay",
            key = cmd.key,
            principal = cmd.tenant,
            skip(a, b),
            ttl = "1h30m",
            on_concurrent = reject,
            conn = self.db as db,
            crate = "::x::idem",
        ));
        assert!(raw.errors.is_none());
        let args = raw.args.expect("complete");
        assert_eq!(args.scope.value(), "orders.pay");
        assert_eq!(args.skip.len(), 2);
        assert_eq!(args.ttl_ms, 5_400_000);
        assert_eq!(args.policy, Policy::Reject);
        assert!(matches!(args.conn, Some(Conn::Expr { .. })));
    }

    #[test]
    fn collects_all_errors() {
        let raw = parse(quote::quote!(scop = "x", ttl = "0s", ttl = "5q"));
        let messages: Vec<String> = raw
            .errors
            .expect("errors")
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        assert!(messages[0].contains("did you mean `scope`"), "{messages:?}");
        assert!(messages.iter().any(|m| m.contains("longer than zero")));
        assert!(
            messages
                .iter()
                .any(|m| m.contains("duplicate argument `ttl`"))
        );
        assert!(messages.iter().any(|m| m.contains("missing unit")));
        assert!(messages.iter().any(|m| m.contains("missing `scope`")));
        assert!(messages.iter().any(|m| m.contains("missing `key`")));
    }

    #[test]
    fn ttl_units() {
        assert_eq!(parse_ttl("24h"), Ok(86_400_000));
        let raw = parse(quote::quote!(
            scope = "s",
            key = k,
            on_concurrent = wait("1500ms")
        ));
        assert_eq!(
            raw.args.expect("complete").policy,
            Policy::Wait {
                bound_ms: Some(1500)
            }
        );
        assert_eq!(parse_ttl("500ms"), Ok(500));
        assert_eq!(parse_ttl("7d"), Ok(604_800_000));
        assert!(parse_ttl("h").is_err());
        assert!(parse_ttl("99999999999999999999d").is_err());
    }
}
