//! The `#[idempotent(...)]` arguments: their model, and a table with each argument's parser.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::meta::ParseNestedMeta;
use syn::parse::discouraged::Speculative;
use syn::parse::{Parse, ParseStream, Parser};
use syn::spanned::Spanned;
use syn::{Expr, Ident, LitInt, LitStr, Path, Token};

/// The attribute's arguments; one not given holds its default. A missing `scope` or `key` is an
/// error that discards the expansion, so theirs are placeholders: they only let the signature
/// checks run, so that those errors are reported too.
pub(crate) struct Args {
    pub(crate) scope: LitStr,
    pub(crate) key: Expr,
    pub(crate) principal: Option<Expr>,
    pub(crate) skip: Vec<Ident>,
    /// `ttl = "24h"`, in milliseconds: the site's TTL (the default when `ttl` is an
    /// expression).
    pub(crate) ttl_ms: u64,
    /// `ttl = settings.ttl`: a TTL evaluated on each call, of type `Duration`.
    pub(crate) ttl_expr: Option<Expr>,
    pub(crate) policy: Policy,
    /// `lease` / `lease = "30s"`: lease mode, with this lease in milliseconds.
    pub(crate) lease_ms: Option<u64>,
    /// `resumable`: the call's arguments are stored with its claim, so a completer can
    /// finish it (lease mode only).
    pub(crate) resumable: bool,
    /// `deadline = "5m"`: how long a lease-mode call's body may run in all, in milliseconds
    /// (the engine's default, a multiple of the lease, when `None`).
    pub(crate) deadline_ms: Option<u64>,
    pub(crate) conn: Option<Conn>,
    pub(crate) krate: Option<Path>,
    /// `answer_version = N`: the version the answer type writes (`idem::Versioned::VERSION`),
    /// checked at compile time against the type.
    pub(crate) answer_version: Option<(u32, Span)>,
    /// `mode = observe`: where `observe` is written (`None` for `enforce`, the default).
    pub(crate) observe: Option<Span>,
    /// Where a bare `on_concurrent = wait` was written: lease mode refuses it.
    bare_wait: Option<Span>,
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

/// How an argument's value, everything after its name, parses into `Args` with its own checks.
type ParseValue = fn(ParseStream<'_>, &mut Args) -> syn::Result<()>;

/// Every argument, in the order the docs list them: its name, the names people reach for
/// instead (they get a "did you mean"), and its value's parser.
const ARGUMENTS: &[(&str, &[&str], ParseValue)] = &[
    ("scope", &["name", "operation"], |input, args| {
        let hint = "`scope` takes a string literal, e.g. `scope = \"orders.pay\"`";
        let scope = string(value(input)?, hint)?;
        let text = scope.value();
        let problem = if text.is_empty() {
            "must not be empty"
        } else if text.len() > 255 {
            "must be at most 255 bytes"
        } else if text.chars().any(char::is_control) {
            "must not contain control characters"
        } else {
            args.scope = scope;
            return Ok(());
        };
        let message = format!("`scope` {problem}; name the operation, e.g. \"orders.pay\"");
        Err(syn::Error::new(scope.span(), message))
    }),
    ("key", &["idempotency_key"], |input, args| {
        args.key = value(input)?.parse()?;
        Ok(())
    }),
    ("principal", &["tenant", "user"], |input, args| {
        args.principal = Some(value(input)?.parse()?);
        Ok(())
    }),
    ("skip", &["exclude", "ignore"], |input, args| {
        let names;
        syn::parenthesized!(names in input);
        args.skip = Vec::from_iter(names.parse_terminated(Ident::parse, Token![,])?);
        Ok(())
    }),
    ("ttl", &["expiry", "expires"], |input, args| {
        let input = value(input)?;
        if input.peek(LitStr) {
            let zero = "a record that expires at once deduplicates nothing";
            args.ttl_ms = duration_ms(input, "ttl", "", zero)?;
        } else if input.peek(LitInt) || input.peek(syn::LitFloat) {
            let number: syn::Lit = input.parse()?;
            return Err(syn::Error::new(
                number.span(),
                "a number has no unit: write the TTL as a string, e.g. `ttl = \"24h\"`, or as a \
                 `Duration` read at run time, e.g. `ttl = settings.record_ttl`",
            ));
        } else {
            args.ttl_expr = Some(input.parse()?);
        }
        Ok(())
    }),
    (
        "on_concurrent",
        &["concurrency", "on_conflict"],
        |input, args| {
            let policy: Ident = value(input)?.parse()?;
            let policies = "expected `wait` (replay once the other call finishes; `wait(\"2s\")` bounds the wait) or `reject` (fail with `InFlight`)";
            args.policy = match policy.to_string().as_str() {
                "wait" if input.peek(syn::token::Paren) => {
                    let hint = "`wait(..)` takes the longest wait as a string, e.g. `wait(\"2s\")`";
                    let zero = "a duplicate would never wait; use `reject` to fail fast";
                    let bound;
                    syn::parenthesized!(bound in input);
                    let bound_ms = Some(duration_ms(&bound, "wait", hint, zero)?);
                    Policy::Wait { bound_ms }
                }
                "wait" => {
                    args.bare_wait = Some(policy.span());
                    Policy::Wait { bound_ms: None }
                }
                "reject" => Policy::Reject,
                other => {
                    let message = format!("unknown policy `{other}`; {policies}");
                    return Err(syn::Error::new(policy.span(), message));
                }
            };
            Ok(())
        },
    ),
    (
        "mode",
        &["observe", "shadow", "dry_run", "enforce"],
        |input, args| {
            let input = value(input)?;
            if input.peek(LitStr) {
                let quoted: LitStr = input.parse()?;
                let message = format!("write the mode without quotes: `mode = {}`", quoted.value());
                return Err(syn::Error::new(quoted.span(), message));
            }
            let hint = "`mode` takes `enforce` or `observe`, e.g. `mode = observe`";
            let mode: Ident = input.parse().map_err(|e| syn::Error::new(e.span(), hint))?;
            args.observe = match mode.to_string().as_str() {
                "enforce" => None,
                "observe" => Some(mode.span()),
                other => return Err(syn::Error::new(mode.span(), unknown_mode(other))),
            };
            Ok(())
        },
    ),
    ("lease", &["lease_ms"], |input, args| {
        if !input.peek(Token![=]) {
            args.lease_ms = Some(30_000); // `lease` alone
            return Ok(());
        }
        let hint =
            "`lease` takes a duration string, e.g. `lease = \"30s\"` (or `lease` alone for 30 s)";
        let zero = "a zero lease ends before the body starts; give the longest the body may take, e.g. `lease = \"30s\"`";
        args.lease_ms = Some(duration_ms(value(input)?, "lease", hint, zero)?);
        Ok(())
    }),
    ("deadline", &["timeout", "max_duration"], |input, args| {
        let hint = "`deadline` takes a duration string, e.g. `deadline = \"5m\"`";
        let zero = "a zero deadline stops the body before it starts; give the longest a call may take in all, e.g. `deadline = \"5m\"`";
        args.deadline_ms = Some(duration_ms(value(input)?, "deadline", hint, zero)?);
        Ok(())
    }),
    (
        "resumable",
        &["resume", "durable", "complete"],
        |input, args| {
            if input.peek(Token![=]) {
                return Err(input.error("`resumable` takes no value: write `resumable`"));
            }
            args.resumable = true;
            Ok(())
        },
    ),
    (
        "answer_version",
        &["version", "answer", "versioned", "answers"],
        |input, args| {
            let hint = "`answer_version` takes the version the answer type writes (its `idem::Versioned::VERSION`), e.g. `answer_version = 2`";
            let literal: LitInt = value(input)?
                .parse()
                .map_err(|e| syn::Error::new(e.span(), hint))?;
            let version = literal
                .base10_parse::<u32>()
                .ok()
                .filter(|&version| version >= 1)
                .ok_or_else(|| {
                    let message = format!(
                        "`answer_version = {literal}`: versions start at 1 (the shape before the type was versioned); {hint}"
                    );
                    syn::Error::new(literal.span(), message)
                })?;
            args.answer_version = Some((version, literal.span()));
            Ok(())
        },
    ),
    ("conn", &["db", "store", "connection"], |input, args| {
        args.conn = Some(conn(value(input)?.parse()?)?);
        Ok(())
    }),
    ("crate", &["krate"], |input, args| {
        let hint = "`crate` takes a path as a string, e.g. `crate = \"::my_app::idem\"`";
        let krate = string(value(input)?, hint)?;
        let text = krate.value();
        let message = format!("`crate` must be a path such as \"::my_app::idem\", not \"{text}\"");
        let not_a_path = syn::Error::new(krate.span(), message);
        args.krate = Some(krate.parse().map_err(|_| not_a_path)?);
        Ok(())
    }),
];

/// Parses the arguments, pushing every mistake onto `errors` instead of stopping at the first:
/// an argument whose value does not parse is reported once and skipped up to the next comma.
/// `None` when the list cannot be split into arguments (a name is missing, or a comma).
pub(crate) fn parse(attr: TokenStream, errors: &mut Vec<syn::Error>) -> Option<Args> {
    let mut args = Args {
        scope: LitStr::new("", Span::call_site()),
        key: syn::parse_quote!(()),
        principal: None,
        skip: Vec::new(),
        ttl_ms: 24 * 3_600_000,
        ttl_expr: None,
        policy: Policy::Wait { bound_ms: None },
        lease_ms: None,
        resumable: false,
        deadline_ms: None,
        conn: None,
        krate: None,
        answer_version: None,
        observe: None,
        bare_wait: None,
    };
    // Each argument given, and where its name is written.
    let mut given: Vec<(&str, Span)> = Vec::new();
    let each_argument = syn::meta::parser(|meta| {
        let Some(&(name, _, parse)) = ARGUMENTS.iter().find(|a| meta.path.is_ident(a.0)) else {
            errors.push(unknown_argument(&meta));
            return skip_value(meta.input);
        };
        if given.iter().any(|(seen, _)| *seen == name) {
            errors.push(meta.error(format!("duplicate argument `{name}`; give it once")));
        }
        given.push((name, meta.path.span()));
        // The value parses in a fork, so a mistake inside its brackets is not reported again
        // as an unparsed token when the whole list ends.
        let speculative = meta.input.fork();
        match parse(&speculative, &mut args) {
            Ok(()) => meta.input.advance_to(&speculative),
            Err(error) => {
                errors.push(error);
                skip_value(meta.input)?;
            }
        }
        Ok(())
    });
    if let Err(error) = each_argument.parse2(attr) {
        errors.push(error);
        return None;
    }

    let at = |name| {
        given
            .iter()
            .find(|(seen, _)| *seen == name)
            .map(|&(_, span)| span)
    };
    let example = "#[idempotent(scope = \"orders.pay\", key = cmd.idempotency_key)]";
    for (name, fix) in [
        ("scope", "name the operation"),
        ("key", "say where the idempotency key comes from"),
    ] {
        if at(name).is_none() {
            let message = format!("missing `{name}`: {fix}, e.g. `{example}`");
            errors.push(syn::Error::new(Span::call_site(), message));
        }
    }
    for (name, why) in [
        (
            "resumable",
            "an atomic-mode call needs no completer: a crash rolls it back",
        ),
        (
            "deadline",
            "an atomic-mode call holds a transaction; bound it with the database's statement timeout",
        ),
    ] {
        if let (Some(span), None) = (at(name), args.lease_ms) {
            let message = format!("`{name}` needs lease mode: add `lease = \"30s\"` ({why})");
            errors.push(syn::Error::new(span, message));
        }
    }
    if at("lease").is_some() {
        if let Some(span) = args.bare_wait {
            let message = "in lease mode a duplicate cannot wait on the claim's lock (the claim has committed); \
                 use `reject` (the default: `InFlight` with Retry-After until the lease ends) or \
                 bound the wait, e.g. `wait(\"2s\")`, to poll for the recorded result";
            errors.push(syn::Error::new(span, message));
        }
        // Lease mode answers a duplicate at once by default: its claim is no lock to wait on.
        if at("on_concurrent").is_none() {
            args.policy = Policy::Reject;
        }
    }
    Some(args)
}

/// Past the `=` of `name = value`.
fn value(input: ParseStream<'_>) -> syn::Result<ParseStream<'_>> {
    input.parse::<Token![=]>()?;
    Ok(input)
}

/// A string literal; anything else is an error at that token, with `hint`.
fn string(input: ParseStream<'_>, hint: &str) -> syn::Result<LitStr> {
    input.parse().map_err(|e| syn::Error::new(e.span(), hint))
}

/// Skips the rest of an argument, so that the arguments after it still parse.
fn skip_value(input: ParseStream<'_>) -> syn::Result<()> {
    while !input.is_empty() && !input.peek(Token![,]) {
        input.parse::<proc_macro2::TokenTree>()?;
    }
    Ok(())
}

/// The error for a name no argument has: a "did you mean" where one is likely (a name people
/// reach for, or a misspelling), and every valid name.
fn unknown_argument(meta: &ParseNestedMeta<'_>) -> syn::Error {
    let name = meta.path.to_token_stream().to_string().replace(' ', "");
    let hint = ARGUMENTS
        .iter()
        .find(|(_, mistaken_for, _)| mistaken_for.contains(&name.as_str()))
        .or_else(|| {
            ARGUMENTS
                .iter()
                .find(|a| strsim::levenshtein(a.0, &name) <= 2)
        })
        .map(|a| format!(" (did you mean `{}`?)", a.0))
        .unwrap_or_default();
    let all = crate::code_list(ARGUMENTS.iter().map(|a| a.0));
    let message = format!("unknown argument `{name}`{hint}; expected one of {all}");
    meta.error(message)
}

/// The error for a `mode` that is neither `enforce` nor `observe`: a "did you mean" for a
/// misspelling or a word people reach for, and what each mode does.
fn unknown_mode(mode: &str) -> String {
    const MODES: &[(&str, &[&str])] = &[
        ("enforce", &["enforcing", "enforced", "strict", "atomic"]),
        (
            "observe",
            &["shadow", "observed", "observing", "dry_run", "audit", "log"],
        ),
    ];
    let hint = MODES
        .iter()
        .find(|(_, mistaken_for)| mistaken_for.contains(&mode))
        .or_else(|| {
            MODES
                .iter()
                .find(|(name, _)| strsim::levenshtein(name, mode) <= 2)
        })
        .map(|(name, _)| format!(" (did you mean `{name}`?)"))
        .unwrap_or_default();
    let lease = if mode == "lease" {
        "; lease mode is an argument of its own, `lease = \"30s\"`"
    } else {
        ""
    };
    format!(
        "unknown mode `{mode}`{hint}; expected `enforce` (the default: idem replays, answers 409 and 422) or `observe` (the body runs every call; idem logs and counts what it would have done){lease}"
    )
}

/// A duration such as `"24h"`, `"90s"`, `"1h30m"` or `"500ms"`, in milliseconds. Errors span the
/// literal and name the argument (`what`); `hint` says how to write one that is no string
/// literal, `zero` why a zero duration is refused.
fn duration_ms(input: ParseStream<'_>, what: &str, hint: &str, zero: &str) -> syn::Result<u64> {
    const UNITS_MS: &[(&str, u64)] = &[
        ("ms", 1), // before "m"
        ("s", 1_000),
        ("m", 60_000),
        ("h", 3_600_000),
        ("d", 86_400_000),
    ];
    let literal = string(input, hint)?;
    let (text, span) = (literal.value(), literal.span());
    let hint = "write it as a number and a unit: `30s`, `15m`, `24h`, `7d` or `1h30m`";
    let error = |problem: String| Err(syn::Error::new(span, format!("{problem}; {hint}")));
    if text.is_empty() {
        return error(format!("empty `{what}`"));
    }
    let (mut total, mut rest) = (0_u64, text.as_str());
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let unit = UNITS_MS
            .iter()
            .find(|(unit, _)| rest[digits..].starts_with(unit));
        let (1.., Some((unit, unit_ms))) = (digits, unit) else {
            let missing = if digits == 0 { "" } else { ": missing unit" };
            return error(format!("invalid `{what}` \"{text}\"{missing}"));
        };
        let ms = rest[..digits]
            .parse()
            .ok()
            .and_then(|n: u64| n.checked_mul(*unit_ms));
        let too_large = || syn::Error::new(span, format!("`{what}` \"{text}\" is too large"));
        total = ms
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(too_large)?;
        rest = &rest[digits + unit.len()..];
    }
    if total == 0 {
        return error(format!("`{what}` must be longer than zero: {zero}"));
    }
    Ok(total)
}

/// `conn = db` (a parameter) or `conn = <expression> as db` (and the body's name for it).
fn conn(expr: Expr) -> syn::Result<Conn> {
    let plain_name = |tokens: &dyn ToTokens| syn::parse2::<Ident>(tokens.to_token_stream()).ok();
    if let Some(param) = plain_name(&expr) {
        return Ok(Conn::Param(param));
    }
    let Expr::Cast(cast) = expr else {
        let message =
            "name the transaction the body uses: `conn = self.db as db` (or `conn = <parameter>`)";
        return Err(syn::Error::new(expr.span(), message));
    };
    let message = "after `as`, name the transaction the body uses, e.g. `conn = self.db as db`";
    let binding = plain_name(&cast.ty).ok_or_else(|| syn::Error::new(cast.ty.span(), message))?;
    let expr = *cast.expr;
    Ok(Conn::Expr { expr, binding })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_argument() {
        let mut errors = Vec::new();
        let tokens = quote::quote! {
            scope = "orders.pay", key = cmd.key, principal = cmd.tenant, skip(a, b), ttl = "1h30m",
            on_concurrent = wait("1500ms"), mode = enforce, lease, answer_version = 2, conn = self.db as db,
            crate = "::x::idem",
        };
        let args = parse(tokens, &mut errors).expect("complete");
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(args.scope.value(), "orders.pay");
        assert_eq!(args.skip.len(), 2);
        assert_eq!(args.ttl_ms, 5_400_000);
        assert_eq!(args.lease_ms, Some(30_000));
        assert!(matches!(
            args.policy,
            Policy::Wait {
                bound_ms: Some(1500)
            }
        ));
        assert!(matches!(args.conn, Some(Conn::Expr { .. })));
        assert_eq!(args.answer_version.map(|(version, _)| version), Some(2));
    }

    #[test]
    fn observe_mode_is_parsed_and_a_misspelt_mode_gets_a_suggestion() {
        let mut errors = Vec::new();
        let tokens = quote::quote! { scope = "orders.pay", key = cmd.key, mode = observe };
        let args = parse(tokens, &mut errors).expect("complete");
        assert!(errors.is_empty(), "{errors:?}");
        assert!(args.observe.is_some());
        let tokens = quote::quote! { scope = "orders.pay", key = cmd.key, mode = obsreve };
        let _ = parse(tokens, &mut errors);
        assert_eq!(errors.len(), 1);
        let message = errors[0].to_string();
        assert!(message.contains("did you mean `observe`?"), "{message}");
        assert!(unknown_mode("shadow").contains("did you mean `observe`?"));
        assert!(unknown_mode("lease").contains("`lease = \"30s\"`"));
    }

    #[test]
    fn a_ttl_expression_is_kept_for_run_time() {
        let mut errors = Vec::new();
        let tokens = quote::quote! { scope = "orders.pay", key = cmd.key, ttl = settings.ttl };
        let args = parse(tokens, &mut errors).expect("complete");
        assert!(errors.is_empty(), "{errors:?}");
        let expr = args.ttl_expr.expect("the expression");
        assert_eq!(expr.to_token_stream().to_string(), "settings . ttl");
        assert_eq!(args.ttl_ms, 24 * 3_600_000, "the site keeps the default");
    }

    #[test]
    fn durations() {
        let ms = |text: &str| {
            let parse = |input: ParseStream<'_>| duration_ms(input, "ttl", "", "");
            parse.parse_str(&format!("{text:?}")).ok()
        };
        assert_eq!(ms("24h"), Some(86_400_000));
        assert_eq!(ms("2m5s"), Some(125_000));
        assert_eq!(ms("500ms"), Some(500));
        assert_eq!(ms("h"), None);
        assert_eq!(ms("99999999999999999999d"), None);
    }
}
