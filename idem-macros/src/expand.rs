//! Signature checks and code generation for `#[idempotent]`. Only glue: every decision is a
//! call into `::idem::__private`: idem-core's `__private` (the engine's entry points and
//! probes), plus `store`, `body_for` and `lease_store`, which the facade defines because they
//! go through its connection traits (`IntoStore`, `IntoLeaseStore`).

use proc_macro2::{Delimiter, Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{Expr, FnArg, Ident, ItemFn, LitStr, Pat, ReturnType, Signature, Type};

use crate::args::{Args, Conn, Policy};

/// What the checks found out about the signature.
struct Plan {
    conn_expr: TokenStream,
    conn_binding: Ident,
    /// The names that go into the fingerprint, each with where its parameter's type is.
    fingerprinted: Vec<(Ident, Range)>,
    /// Atomic mode: every parameter binding but the connection's, with whether it is `mut`,
    /// handed afresh to each try of the body.
    rerun: Vec<(Ident, bool)>,
    output: Type,
}

/// The identifiers a pattern binds (`Point { x, y }` binds `x` and `y`), each with whether it
/// is bound `mut`.
fn bindings(pat: &Pat) -> Vec<(Ident, bool)> {
    struct Bindings(Vec<(Ident, bool)>);
    impl<'ast> Visit<'ast> for Bindings {
        fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
            self.0.push((p.ident.clone(), p.mutability.is_some()));
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut bindings = Bindings(Vec::new());
    bindings.visit_pat(pat);
    bindings.0
}

/// The identifiers a pattern binds.
fn names(pat: &Pat) -> impl Iterator<Item = Ident> {
    bindings(pat).into_iter().map(|(name, _)| name)
}

/// The typed parameters: the receiver is neither fingerprinted nor the connection.
fn typed_params(sig: &Signature) -> impl Iterator<Item = (&Pat, &Type)> {
    sig.inputs.iter().filter_map(|arg| match arg {
        FnArg::Typed(t) => Some((&*t.pat, &*t.ty)),
        FnArg::Receiver(_) => None,
    })
}

/// Checks the signature against the arguments, pushing every problem onto `errors`.
fn plan(args: &Args, sig: &Signature, errors: &mut Vec<syn::Error>) -> Option<Plan> {
    // Each check: the span of what fails it (`None` when it passes), and the fix.
    let checks = [
        (
            sig.constness.map(|c| c.span),
            "`#[idempotent]` cannot wrap a `const fn`: claiming a key needs the database; remove `const`",
        ),
        (
            (sig.asyncness.is_none() && !returns_boxed_future(sig)).then_some(sig.fn_token.span),
            "`#[idempotent]` requires an `async fn`: the claim awaits the database; write `async fn`",
        ),
        (
            (sig.asyncness.is_none() && returns_boxed_future(sig)).then_some(sig.ident.span()),
            "`#[idempotent]` cannot wrap a method of an `#[async_trait]` impl (tonic's `#[tonic::async_trait]` too): that attribute runs first and turns the `async fn` into a `fn` returning a boxed future; put `#[idempotent]` on an inherent `async fn` of the type (`impl MyService { #[idempotent(...)] async fn pay_once(&self, ...) -> Result<T, E> { ... } }`) and have the trait method call it (`self.pay_once(...).await`)",
        ),
        (
            sig.variadic.as_ref().map(Spanned::span),
            "`#[idempotent]` cannot wrap a variadic function",
        ),
        (
            matches!(sig.output, ReturnType::Default).then_some(sig.ident.span()),
            "`#[idempotent]` needs a return type: add `-> Result<T, E>` (`T` is recorded and replayed, `E: From<idem::Error>` carries idem's errors)",
        ),
        (
            impl_trait_span(&sig.output),
            "`#[idempotent]` cannot record an `impl Trait` return value; name a concrete type that implements `Serialize` and `Deserialize`",
        ),
    ];
    let failed = checks
        .into_iter()
        .filter_map(|(span, message)| Some((span?, message)));
    errors.extend(failed.map(|(span, message)| syn::Error::new(span, message)));

    let params: Vec<(&Pat, &Type)> = typed_params(sig).collect();
    let param_names: Vec<Ident> = params.iter().flat_map(|(pat, _)| names(pat)).collect();
    let listing = if param_names.is_empty() {
        "the function has no named parameters".to_owned()
    } else {
        format!("parameters are {}", crate::code_list(&param_names))
    };
    // `skip(..)` and `conn = <parameter>` name parameters, which must exist.
    let conn_named = match &args.conn {
        Some(Conn::Param(name)) => Some((name, format!("conn = {name}"))),
        _ => None,
    };
    let skipped = args.skip.iter().map(|name| (name, format!("skip({name})")));
    for (name, written) in skipped.chain(conn_named) {
        if !param_names.contains(name) {
            let message = format!("`{written}`: no parameter is named `{name}`; {listing}");
            errors.push(syn::Error::new(name.span(), message));
        }
    }

    // Without `conn`, the connection is the first parameter, under its plain name.
    let (conn_expr, conn_binding) = match (&args.conn, params.first()) {
        (Some(Conn::Param(name)), _) => (name.to_token_stream(), name.clone()),
        (Some(Conn::Expr { expr, binding }), _) => (expr.to_token_stream(), binding.clone()),
        (None, Some((Pat::Ident(p), _))) if p.subpat.is_none() => {
            (p.ident.to_token_stream(), p.ident.clone())
        }
        (None, Some((pat, _))) => {
            let message = "the first parameter is the connection and needs a plain name (e.g. `db: &DatabaseConnection`); or name the connection with `conn = ...`";
            errors.push(syn::Error::new(pat.span(), message));
            return None;
        }
        (None, None) => {
            let message = "no connection: make the first parameter the connection (`db: &DatabaseConnection`), or name it with `conn = self.db as db`";
            errors.push(syn::Error::new(sig.paren_token.span.join(), message));
            return None;
        }
    };
    // A connection parameter is rebound to the transaction, not fingerprinted.
    let conn_param = (!matches!(args.conn, Some(Conn::Expr { .. }))).then_some(&conn_binding);
    let resumable = args.resumable && args.lease_ms.is_some();
    let single_try = runs_once(args, sig);
    let (mut fingerprinted, mut rerun) = (Vec::new(), Vec::new());
    for (pat, ty) in params {
        let first = fingerprinted.len();
        for (name, mutable) in bindings(pat) {
            if Some(&name) == conn_param {
                continue;
            }
            if !single_try {
                rerun.push((name.clone(), mutable));
            }
            if !args.skip.contains(&name) {
                fingerprinted.push((name, Range::of(ty)));
            }
        }
        // A borrowed argument cannot be rebuilt by a completer: say so at the type (serde's
        // own error names lifetimes, not the fix).
        if let (true, Type::Reference(reference), Some((name, _))) =
            (resumable, ty, fingerprinted.get(first))
        {
            let message = format!(
                "`{name}` is borrowed, but a resumable call stores its arguments for a completer to rebuild: take an owned type (`String` for `&str`, `Vec<T>` for `&[T]`), or `skip({name})` and supply it in the completer's resumer"
            );
            errors.push(syn::Error::new_spanned(reference, message));
        }
    }
    let ReturnType::Type(_, output) = &sig.output else {
        return None;
    };
    Some(Plan {
        conn_expr,
        conn_binding,
        fingerprinted,
        rerun,
        output: (**output).clone(),
    })
}

/// Whether the body runs at most once per call: a lease-mode method that takes `self` by value
/// (`self`, `self: Arc<Self>`) cannot hand it to a second try, so a conflict of its final
/// phase is answered (atomic mode refuses such a method: its tries share `self`).
fn runs_once(args: &Args, sig: &Signature) -> bool {
    let by_value = sig.receiver().is_some_and(|receiver| match &receiver.kind {
        syn::ReceiverKind::Reference(..) => false,
        syn::ReceiverKind::Typed(_, ty) => !matches!(**ty, Type::Reference(_)),
        _ => true,
    });
    args.lease_ms.is_some() && by_value
}

/// Whether `sig` returns `Pin<Box<...>>`: an `async fn` that `#[async_trait]` has already
/// rewritten (it returns `Pin<Box<dyn Future<Output = T> + Send + 'async_trait>>`).
pub(crate) fn returns_boxed_future(sig: &Signature) -> bool {
    let ReturnType::Type(_, ty) = &sig.output else {
        return false;
    };
    matches!(&**ty, Type::Path(path) if path.path.segments.last().is_some_and(|last| last.ident == "Pin"))
}

/// The function as written, for when the attribute has errors: only what the reported errors
/// already cover is adjusted, so they are not repeated. Parameters are marked used (the
/// attribute would have used them: no "unused variable" for `key`), and `const` is dropped
/// from a `const async fn` (rustc would reject the pair again).
pub(crate) fn fallback(mut item: ItemFn) -> TokenStream {
    // An `#[async_trait]` method: its body names what the attribute would have bound (`db`);
    // the signature alone keeps the impl whole without errors the real one already explains.
    let names: Vec<Ident> = typed_params(&item.sig)
        .flat_map(|(pat, _)| names(pat))
        .collect();
    if returns_boxed_future(&item.sig) {
        if let Ok(block) = syn::parse2(quote!({ #(let _ = &#names;)* ::core::unimplemented!() })) {
            item.block = block;
        }
        return item.into_token_stream();
    }
    if item.sig.asyncness.is_some() {
        item.sig.constness = None;
    }
    let body = &item.block;
    if let Ok(block) = syn::parse2(quote!({ #(let _ = &#names;)* #body })) {
        item.block = block;
    }
    item.into_token_stream()
}

/// Where some user tokens are: their first and last token. Generated code whose first token
/// sits at `first` and last at `last` is reported over exactly those tokens (a stable proc
/// macro cannot join spans itself).
#[derive(Clone, Copy)]
struct Range {
    first: Span,
    last: Span,
}

impl Range {
    fn of(tokens: &impl ToTokens) -> Self {
        let mut tokens = tokens.to_token_stream().into_iter();
        let first = tokens.next().map_or_else(Span::call_site, |t| match &t {
            TokenTree::Group(g) => g.span_open(),
            other => other.span(),
        });
        let last = tokens.last().map_or(first, |t| match &t {
            TokenTree::Group(g) => g.span_close(),
            other => other.span(),
        });
        Self { first, last }
    }

    /// `callee(leading, &operand)`, which rustc reports over the range (operand ending at `last`).
    fn call_with_borrow(
        self,
        callee: &TokenStream,
        leading: &TokenStream,
        operand: &TokenStream,
    ) -> TokenStream {
        let borrow = quote_spanned!(self.first=> &);
        self.call(callee, &quote!(#leading #borrow #operand))
    }

    /// `callee(args)`, which rustc reports over the range (`args` ending at `last`). The
    /// call's own tokens take the user's spans as they are: spans join only within one
    /// hygiene context, and a callee over the same range as the argument gets no extra label.
    /// A proc macro's call-site tokens resolve like the user's, so resolution is unchanged.
    fn call(self, callee: &TokenStream, args: &TokenStream) -> TokenStream {
        let mut callee: Vec<TokenTree> = callee.clone().into_iter().collect();
        for token in &mut callee {
            token.set_span(self.first);
        }
        if let Some(token) = callee.last_mut() {
            token.set_span(self.last);
        }
        let mut args = Group::new(Delimiter::Parenthesis, args.clone());
        args.set_span(self.last);
        quote!(#(#callee)* #args)
    }
}

/// `expr` as the operand of `&`. Parentheses only where `&` would bind tighter: added ones
/// would stand for the expression in error messages, with a one-token span.
fn borrow_operand(expr: &Expr) -> TokenStream {
    use Expr::*;
    match expr {
        Path(_) | Field(_) | MethodCall(_) | Call(_) | Index(_) | Lit(_) | Paren(_) | Tuple(_)
        | Array(_) | Struct(_) | Macro(_) | Try(_) | Await(_) | Reference(_) | Unary(_)
        | Block(_) => expr.to_token_stream(),
        _ => quote!((#expr)),
    }
}

/// `tokens` reported at `span`, all of them on the same span (rustc merges errors only on
/// equal spans). Identifiers resolve as the macro's own (call-site) tokens do.
fn respan(tokens: &TokenStream, span: Span) -> TokenStream {
    let span = Span::call_site().located_at(span);
    let respan_token = |token| match token {
        TokenTree::Group(group) => {
            let mut inner = Group::new(group.delimiter(), respan(&group.stream(), span));
            inner.set_span(span);
            TokenTree::Group(inner)
        }
        mut other => {
            other.set_span(span);
            other
        }
    };
    tokens.clone().into_iter().map(respan_token).collect()
}

/// The first `impl Trait` in the return type: its value cannot be recorded.
fn impl_trait_span(output: &ReturnType) -> Option<Span> {
    struct Finder(Option<Span>);
    impl<'ast> Visit<'ast> for Finder {
        fn visit_type_impl_trait(&mut self, t: &'ast syn::TypeImplTrait) {
            self.0.get_or_insert(t.impl_token.span);
        }
    }
    let mut finder = Finder(None);
    finder.visit_return_type(output);
    finder.0
}

/// Input:
/// ```text
/// #[idempotent(scope = "orders.pay", key = cmd.key)]
/// async fn pay(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, PayError> { BODY }
/// ```
/// Output (abridged):
/// ```text
/// async fn pay(db: &DatabaseConnection, cmd: Pay) -> Result<Receipt, PayError> {
///     static __IDEM_SITE: Site = Site::new("orders.pay", ttl, policy);
///     let __idem_conn = &(db);
///     let mut __idem_call = Call::new(&__IDEM_SITE, &cmd.key);
///     Call::named_arg(&mut __idem_call, "cmd", &cmd);
///     let __idem_arg_cmd = Rerun::new(cmd, "cmd");
///     // claim; replay, or run the body in the claim's transaction; record + commit, or release
///     run::<_, Result<Receipt, PayError>, _, _>(
///         store(__idem_conn),
///         __idem_call,
///         (&&FinalProbe::<PayError>::new()).finality(),
///         // a factory: each try (after a conflict) gets its own body and arguments
///         move || {
///             let cmd = (&&RerunProbe(&__idem_arg_cmd)).next_try("orders.pay")?;
///             Ok(body_for(__idem_conn, async move |db| -> Result<Receipt, PayError> {
///                 let __idem_out: Result<Receipt, PayError> = { BODY };
///                 __idem_out
///             }))
///         }).await
/// }
/// ```
pub(crate) fn expand(
    args: &Args,
    mut item: ItemFn,
    errors: &mut Vec<syn::Error>,
) -> Option<TokenStream> {
    let Plan {
        conn_expr,
        conn_binding,
        fingerprinted,
        rerun,
        output,
    } = plan(args, &item.sig, errors).filter(|_| errors.is_empty())?;

    let p = match &args.krate {
        Some(krate) => quote!(#krate::__private),
        None => quote!(::idem::__private),
    };
    let (scope, ttl_ms) = (&args.scope, args.ttl_ms);
    let concurrency = match args.policy {
        Policy::Reject => quote!(#p::Concurrency::Reject),
        Policy::Wait { bound_ms: None } => quote!(#p::Concurrency::DEFAULT),
        Policy::Wait { bound_ms: Some(ms) } => {
            quote!(#p::Concurrency::Wait { bound: #p::Duration::from_millis(#ms) })
        }
    };
    // Each call whose bounds rustc checks covers exactly the user's tokens it checks (the key
    // expression, a parameter's type, the return type), so the error lands there, once.
    // The key and the principal go to the call as the user wrote them; the call takes each
    // as a `KeySource`, so a type that is not one is an error at its expression.
    let new_call = Range::of(&args.key).call_with_borrow(
        &quote!(#p::Call::new),
        &quote!(&__IDEM_SITE,),
        &borrow_operand(&args.key),
    );
    let principal = args.principal.as_ref().map(|expr| {
        let call = Range::of(expr).call_with_borrow(
            &quote!(#p::Call::principal),
            &quote!(&mut __idem_call,),
            &borrow_operand(expr),
        );
        quote!(#call;)
    });
    // A TTL read at run time replaces the site's; a mistyped one is an error at its tokens.
    let ttl = args.ttl_expr.as_ref().map(|expr| {
        let call = Range::of(expr).call(&quote!(#p::Call::ttl), &quote!(&mut __idem_call, #expr));
        quote!(#call;)
    });
    // (`deadline` and `resumable` without a lease are errors, which discard the expansion.)
    let deadline = args
        .deadline_ms
        .map(|ms| quote!(__idem_call.deadline(#p::Duration::from_millis(#ms));));
    // Observe mode: the engine decides and reports, and the body answers every call.
    let mode = args
        .observe
        .map(|_| quote!(#p::Call::mode(&mut __idem_call, #p::Mode::Observe);));
    // The call carries the user's spans, so clippy sees `_name` used as user code.
    let allow_underscored = |name: &Ident| {
        let underscored = name.to_string().starts_with('_');
        underscored.then(|| quote!(#[allow(clippy::used_underscore_binding)]))
    };
    // Each argument is fingerprinted under its parameter's name, so a parameter added as
    // `None` is left out and the order of parameters does not matter. A resumable call also
    // stores each one, for a completer to rebuild the call from: its type must read back (the
    // bound is checked at the parameter's type).
    let fingerprint_args = fingerprinted.iter().map(|(name, ty)| {
        let label = LitStr::new(&name.unraw().to_string(), name.span());
        let allow = allow_underscored(name);
        let name = Ident::new(&name.to_string(), name.span().located_at(ty.last));
        let name = name.to_token_stream();
        let leading = quote!(&mut __idem_call, #label,);
        let call = ty.call_with_borrow(&quote!(#p::Call::named_arg), &leading, &name);
        let stored = args.resumable.then(|| {
            let call = ty.call_with_borrow(
                &quote!(#p::Call::store_arg),
                &quote!(&mut __idem_call,),
                &name,
            );
            quote!(#allow #call;)
        });
        quote!(#allow #call; #stored)
    });
    let conn_span = Span::call_site().located_at(conn_expr.span());
    let conn = Ident::new("__idem_conn", conn_span);
    // `run` checks the return type's bounds, and so does every use of its future (the
    // `.await`). All of that glue, the return type inside it included, sits on one span (the
    // return type's first token), so rustc reports an unsuitable type once.
    let at = Range::of(&output).first;
    let error_type = quote!(<#output as #p::HandlerOutput>::Error);
    let value_type = quote!(<#output as #p::HandlerOutput>::Ok);
    // The versions the answers are recorded and read as: each type's `Versioned` version,
    // or 1 (autoref specialisation, as for finality).
    let versions = respan(
        &quote! {
            #p::Call::answer_versions(
                &mut __idem_call,
                (&&#p::VersionProbe::<#value_type>::new()).answer_version(),
                (&&#p::VersionProbe::<#error_type>::new()).answer_version(),
            );
        },
        at,
    );
    // `answer_version = N` pins the version at the handler: the type must be `Versioned`, with
    // that `VERSION` (a compile error at the number otherwise). A `const` item is checked by
    // `cargo check`; a generic handler's type can only be checked in an inline `const`, when
    // the handler is instantiated.
    let generic = !item.sig.generics.params.is_empty();
    let pinned = args.answer_version.map(|(version, span)| {
        let message = format!(
            "`answer_version = {version}`, but the answer type's `idem::Versioned::VERSION` is another: set `answer_version` to the type's `VERSION`, or set `VERSION` to {version} with an `upcast` from the version before"
        );
        let check = quote! {
            ::core::assert!(<#value_type as #p::Versioned>::VERSION == #version, #message)
        };
        let check = match generic {
            true => quote!(const { #check };),
            false => quote!(const _: () = #check;),
        };
        respan(&check, span)
    });
    let finality = respan(
        &quote!((&&#p::FinalProbe::<#error_type>::new()).finality()),
        at,
    );
    // A try the database aborts for a conflict is run again (atomic mode's claim transaction,
    // lease mode's final phase kept open for the result), so the body is handed its arguments
    // afresh each time (a clone, or the value itself for the one try a non-`Clone` argument
    // allows).
    let holder =
        |name: &Ident| format_ident!("__idem_arg_{}", name.unraw(), span = Span::call_site());
    let holders = rerun.iter().map(|(name, _)| {
        let (allow, holder, written) = (
            allow_underscored(name),
            holder(name),
            name.unraw().to_string(),
        );
        quote!(#allow let #holder = #p::Rerun::new(#name, #written);)
    });
    let takes = rerun.iter().map(|(name, mutable)| {
        let (holder, mutability) = (holder(name), mutable.then(|| quote!(mut)));
        quote! {
            #[allow(unused_variables, unused_mut)]
            let #mutability #name = (&&#p::RerunProbe(&#holder)).next_try(#scope)?;
        }
    });
    // The parameters themselves are only moved into their holders now.
    for input in &mut item.sig.inputs {
        if let FnArg::Typed(typed) = input
            && bindings(&typed.pat).iter().any(|(_, mutable)| *mutable)
        {
            typed.attrs.push(syn::parse_quote!(#[allow(unused_mut)]));
        }
    }
    // The `let` gives the body its expected type, so a type mismatch is reported inside it.
    let body = &item.block;
    let closure = |param: TokenStream| {
        quote! {
            async move |#param| -> #output {
                let __idem_out: #output = #body;
                #[allow(unreachable_code)] // after a body that ends in `return`
                __idem_out
            }
        }
    };
    // The mode decides the engine entry, its leading arguments and the body's closure; the
    // rest of the expansion is shared. (The connection's bound and its projection sit on one
    // span, so that rustc reports them once.) A factory makes the body for each try, with its
    // own arguments.
    let (entry, leading, body) = match args.lease_ms {
        // Lease mode: the body runs outside any claim transaction, on the connection itself
        // (under the name `conn = expr as name` gives it); its steps and final phase reach the
        // lease through `idem::step` and `idem::sea_orm::final_step`.
        Some(lease_ms) => {
            let lease_store = respan(&quote!(#p::lease_store(#conn)), conn.span());
            let lease = quote!(#p::Duration::from_millis(#lease_ms));
            let leading = quote!(#lease_store, __idem_call, #lease,);
            (
                quote!(run_lease::<#output, _, _>),
                leading,
                closure(quote!()),
            )
        }
        // Atomic mode: the body sees the claim's transaction under the connection's name, so
        // its writes commit (or roll back) together with the recorded result.
        None => {
            let store_call = respan(&quote!(#p::store(#conn)), conn.span());
            let body_for = respan(&quote!(#p::body_for), conn.span());
            let closure = closure(quote!(#[allow(unused_variables)] #conn_binding));
            (
                quote!(run::<_, #output, _, _>),
                quote!(#store_call, __idem_call,),
                quote!(#body_for(#conn, #closure)),
            )
        }
    };
    let factory = if runs_once(args, &item.sig) {
        quote!(#p::once(#body))
    } else {
        quote! {
            move || {
                #(#takes)*
                ::core::result::Result::Ok(#body)
            }
        }
    };
    let rebind = match (&args.conn, args.lease_ms) {
        (Some(Conn::Expr { binding, .. }), Some(_)) => Some(quote!(let #binding = #conn;)),
        _ => None,
    };
    let entry = respan(&quote!(#p::#entry), at);
    let run_args = quote! {
        #leading
        #finality,
        #factory,
    };
    let mut run_args = Group::new(Delimiter::Parenthesis, run_args);
    run_args.set_span(Span::call_site().located_at(at));
    let dot_await = respan(&quote!(.await), at);

    let new_body = quote! {{
        #[allow(unused_imports)]
        use #p::{
            ViaClone as _, ViaFinal as _, ViaMove as _, ViaPlain as _, ViaUnversioned as _,
            ViaVersioned as _,
        };
        static __IDEM_SITE: #p::Site = #p::Site::new(
            #scope,
            #p::Duration::from_millis(#ttl_ms),
            #concurrency,
        );
        // A borrow in a `let` keeps a temporary connection (`conn = self.pool() as db`) alive.
        let #conn = &(#conn_expr);
        let mut __idem_call = #new_call;
        #principal
        #ttl
        #deadline
        #mode
        #(#fingerprint_args)*
        #versions
        #pinned
        #(#holders)*
        #rebind
        #entry #run_args #dot_await
    }};
    match syn::parse2(new_body) {
        Ok(block) => item.block = block,
        Err(error) => errors.push(error),
    }
    errors.is_empty().then(|| item.into_token_stream())
}
