//! Signature checks and code generation for `#[idempotent]`. Only glue: every decision is a
//! call into `::idem::__private`, which lives in idem-core.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::{FnArg, Ident, ItemFn, Pat, ReturnType, Type};

use crate::args::{Args, Conn};

/// A parameter that goes into the fingerprint: the names it binds, and its type's span.
struct Fingerprinted {
    names: Vec<Ident>,
    ty_span: Span,
}

/// What the checks found out about the signature.
struct Plan {
    conn_expr: TokenStream,
    conn_binding: Ident,
    fingerprinted: Vec<Fingerprinted>,
    output: Type,
}

/// Collects the identifiers a pattern binds (`Point { x, y }` binds `x` and `y`).
#[derive(Default)]
struct Bindings(Vec<Ident>);

impl<'ast> Visit<'ast> for Bindings {
    fn visit_pat_ident(&mut self, p: &'ast syn::PatIdent) {
        self.0.push(p.ident.clone());
        syn::visit::visit_pat_ident(self, p);
    }
}

fn bindings(pat: &Pat) -> Vec<Ident> {
    let mut b = Bindings::default();
    b.visit_pat(pat);
    b.0
}

/// Checks the signature against the arguments; every problem is collected.
fn plan(args: &Args, item: &ItemFn, errors: &mut Vec<syn::Error>) -> Option<Plan> {
    let sig = &item.sig;
    if let Some(constness) = &sig.constness {
        errors.push(syn::Error::new(
            constness.span(),
            "`#[idempotent]` cannot wrap a `const fn`: claiming a key needs the database; remove `const`",
        ));
    }
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span(),
            "`#[idempotent]` requires an `async fn`: the claim awaits the database; write `async fn`",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(syn::Error::new(
            variadic.span(),
            "`#[idempotent]` cannot wrap a variadic function",
        ));
    }
    let output = match &sig.output {
        ReturnType::Default => {
            errors.push(syn::Error::new(
                sig.ident.span(),
                "`#[idempotent]` handlers return `Result<T, E>`: `T` is recorded and replayed, `E: From<idem::Error>` carries idem's errors; add a return type",
            ));
            None
        }
        ReturnType::Type(_, ty) => {
            if let Some(span) = impl_trait_span(ty) {
                errors.push(syn::Error::new(
                    span,
                    "`#[idempotent]` cannot record an `impl Trait` return value; name a concrete type that implements `Serialize` and `Deserialize`",
                ));
                None
            } else {
                Some((**ty).clone())
            }
        }
    };

    let params: Vec<(&Pat, &Type)> = sig
        .inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Typed(t) => Some((&*t.pat, &*t.ty)),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let param_names: Vec<String> = params
        .iter()
        .flat_map(|(pat, _)| bindings(pat))
        .map(|i| i.to_string())
        .collect();
    let listing = || {
        if param_names.is_empty() {
            "the function has no named parameters".to_owned()
        } else {
            format!(
                "parameters are {}",
                param_names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    };
    for name in &args.skip {
        if !param_names.iter().any(|p| name == p) {
            errors.push(syn::Error::new(
                name.span(),
                format!(
                    "`skip({name})`: no parameter is named `{name}`; {}",
                    listing()
                ),
            ));
        }
    }

    let param_ident = |pat: &Pat| match pat {
        Pat::Ident(p) if p.subpat.is_none() => Some(p.ident.clone()),
        _ => None,
    };
    let (conn_expr, conn_binding, conn_param) = match &args.conn {
        Some(Conn::Param(name)) => {
            if !param_names.iter().any(|p| name == p) {
                errors.push(syn::Error::new(
                    name.span(),
                    format!(
                        "`conn = {name}`: no parameter is named `{name}`; {}",
                        listing()
                    ),
                ));
            }
            (name.to_token_stream(), name.clone(), Some(name.to_string()))
        }
        Some(Conn::Expr { expr, binding }) => (expr.to_token_stream(), binding.clone(), None),
        None => match params.first() {
            Some((pat, _)) => match param_ident(pat) {
                Some(ident) => (
                    ident.to_token_stream(),
                    ident.clone(),
                    Some(ident.to_string()),
                ),
                None => {
                    errors.push(syn::Error::new(
                        pat.span(),
                        "the first parameter is the connection and needs a plain name (e.g. `db: &DatabaseConnection`); or name the connection with `conn = ...`",
                    ));
                    return None;
                }
            },
            None => {
                errors.push(syn::Error::new(
                    sig.paren_token.span.join(),
                    "no connection: make the first parameter the connection (`db: &DatabaseConnection`), or name it with `conn = self.db as db`",
                ));
                return None;
            }
        },
    };

    let fingerprinted = params
        .iter()
        .filter_map(|(pat, ty)| {
            let names: Vec<Ident> = bindings(pat)
                .into_iter()
                .filter(|n| conn_param.as_deref() != Some(&n.to_string()))
                .filter(|n| !args.skip.iter().any(|s| s == n))
                .collect();
            (!names.is_empty()).then(|| Fingerprinted {
                names,
                ty_span: ty.span(),
            })
        })
        .collect();
    Some(Plan {
        conn_expr,
        conn_binding,
        fingerprinted,
        output: output?,
    })
}

fn impl_trait_span(ty: &Type) -> Option<Span> {
    struct Finder(Option<Span>);
    impl<'ast> Visit<'ast> for Finder {
        fn visit_type_impl_trait(&mut self, t: &'ast syn::TypeImplTrait) {
            self.0.get_or_insert(t.impl_token.span);
        }
    }
    let mut finder = Finder(None);
    finder.visit_type(ty);
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
///     let mut __idem_call = Call::new(&__IDEM_SITE, store(&db), key(&(cmd.key)));
///     __idem_call.arg(&cmd);
///     let __idem_guard = match __idem_call.claim::<Result<..>>(finality).await {
///         Ok(guard) => guard,
///         Err(answer) => return answer,          // replay, or an idem error
///     };
///     let db = __idem_guard.tx();                // the body sees the claim's transaction
///     let __idem_out: Result<..> = async move { BODY }.await;
///     __idem_guard.finish(__idem_out).await      // record + commit, or release
/// }
/// ```
pub(crate) fn expand(args: &Args, mut item: ItemFn) -> syn::Result<TokenStream> {
    let mut errors = Vec::new();
    let plan = plan(args, &item, &mut errors);
    let mut errors = errors.into_iter();
    if let Some(mut first) = errors.next() {
        errors.for_each(|e| first.combine(e));
        return Err(first);
    }
    let Some(plan) = plan else {
        return Ok(item.into_token_stream());
    };

    let krate = args
        .krate
        .as_ref()
        .map_or_else(|| quote!(::idem), ToTokens::to_token_stream);
    let p = quote!(#krate::__private);
    let scope = &args.scope;
    let ttl_ms = args.ttl_ms;
    let concurrency = if args.reject {
        quote!(#p::Concurrency::Reject)
    } else {
        quote!(#p::Concurrency::DEFAULT)
    };
    let key = &args.key;
    let key_call = quote_spanned!(key.span()=> #p::key(&(#key)));
    let principal = args.principal.as_ref().map(|principal| {
        let call = quote_spanned!(principal.span()=> #p::key(&(#principal)));
        quote!(__idem_call.principal(#call);)
    });
    let fingerprint_args = plan.fingerprinted.iter().flat_map(|f| {
        f.names
            .iter()
            .map(move |name| quote_spanned!(f.ty_span=> __idem_call.arg(&#name);))
    });
    let Plan {
        conn_expr,
        conn_binding,
        output,
        ..
    } = plan;
    let store_call = quote_spanned!(conn_expr.span()=> #p::store(&#conn_expr));
    let claim = quote_spanned!(output.span()=>
        __idem_call.claim::<#output>(
            (&&#p::FinalProbe::<<#output as #p::HandlerOutput>::Error>::new()).finality()
        )
    );

    let (inner_attrs, outer_attrs): (Vec<_>, Vec<_>) = item
        .attrs
        .drain(..)
        .partition(|a| matches!(a.style, syn::AttrStyle::Inner(_)));
    item.attrs = outer_attrs;
    let body = &item.block;
    let new_body = quote! {{
        #(#inner_attrs)*
        #[allow(unused_imports)]
        use #p::{ViaFinal as _, ViaPlain as _};
        static __IDEM_SITE: #p::Site = #p::Site::new(
            #scope,
            #p::Duration::from_millis(#ttl_ms),
            #concurrency,
        );
        let mut __idem_call = #p::Call::new(&__IDEM_SITE, #store_call, #key_call);
        #principal
        #(#fingerprint_args)*
        let __idem_guard = match #claim.await {
            ::core::result::Result::Ok(guard) => guard,
            ::core::result::Result::Err(answer) => return answer,
        };
        // The body sees the claim's transaction under the connection's name, so its writes
        // commit (or roll back) together with the recorded result.
        #[allow(unused_variables)]
        let #conn_binding = __idem_guard.tx();
        let __idem_out: #output = async move #body.await;
        __idem_guard.finish(__idem_out).await
    }};
    item.block = syn::parse2(new_body)?;
    Ok(item.into_token_stream())
}
