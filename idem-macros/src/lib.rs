//! Implementation detail of [`idem`](https://docs.rs/idem): the `#[idempotent]` attribute.
//! Use it through the `idem` crate, whose docs describe it in full.

mod args;
mod expand;
mod state;

use proc_macro::TokenStream;
use quote::ToTokens;

/// Makes an `async fn` safe to retry. See the `idem` crate for the full documentation.
#[proc_macro_attribute]
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let output = idempotent_impl(attr.into(), item.into());
    if std::env::var_os("IDEM_MACROS_DEBUG").is_some() {
        eprintln!("{output}");
    }
    output.into()
}

/// Declares a state enum's transitions. See `idem::StateMachine`.
#[proc_macro_derive(StateMachine, attributes(transitions, state_machine))]
pub fn derive_state_machine(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    state::derive(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// A transition checked at compile time. See `idem::transition!`.
#[proc_macro]
pub fn transition(input: TokenStream) -> TokenStream {
    let call = syn::parse_macro_input!(input as state::TransitionCall);
    state::transition(&call).into()
}

fn idempotent_impl(
    attr: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let parsed = syn::parse2::<args::RawArgs>(attr);
    // If the item is not a function, say so and leave it alone.
    let function = match syn::parse2::<syn::ItemFn>(item.clone()) {
        Ok(function) => function,
        Err(_) => {
            let mut out = item;
            out.extend(
                syn::Error::new(
                    proc_macro2::Span::call_site(),
                    "`#[idempotent]` goes on an `async fn` (a free function or a method)",
                )
                .into_compile_error(),
            );
            return out;
        }
    };
    // On any error: the original function, plus every error at once.
    let fail = |function: syn::ItemFn, error: syn::Error| {
        let mut out = expand::fallback(function);
        out.extend(error.into_compile_error());
        out
    };
    let raw = match parsed {
        Ok(raw) => raw,
        Err(e) => return fail(function, e),
    };
    let (args, arg_errors) = (raw.args, raw.errors);
    let expanded = match args {
        Some(args) => expand::expand(&args, function.clone()),
        None => Ok(function.to_token_stream()),
    };
    match (expanded, arg_errors) {
        (Ok(tokens), None) => tokens,
        (Ok(_), Some(e)) | (Err(e), None) => fail(function, e),
        (Err(signature_errors), Some(mut all)) => {
            all.combine(signature_errors);
            fail(function, all)
        }
    }
}
