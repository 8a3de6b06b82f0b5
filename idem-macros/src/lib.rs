//! Implementation detail of [`idem`](https://docs.rs/idempotence): the `#[idempotent]` attribute.
//! Use it through the `idempotence` crate (imported as `idem`), whose docs describe it in
//! full.

mod args;
mod expand;
mod state;

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use syn::Error;

/// Makes an `async fn` safe to retry. See the `idempotence` crate for the full documentation.
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
    let derived = syn::parse(input).and_then(|input| state::derive(&input));
    derived.unwrap_or_else(Error::into_compile_error).into()
}

/// A transition checked at compile time. See `idem::transition!`.
#[proc_macro]
pub fn transition(input: TokenStream) -> TokenStream {
    let expanded = syn::parse::Parser::parse(state::transition, input);
    expanded.unwrap_or_else(Error::into_compile_error).into()
}

fn idempotent_impl(attr: TokenStream2, item: TokenStream2) -> TokenStream2 {
    // If the item is not a function, say so and leave it alone.
    let Ok(function) = syn::parse2::<syn::ItemFn>(item.clone()) else {
        let message = "`#[idempotent]` goes on an `async fn` (a free function or a method)";
        let error = Error::new(Span::call_site(), message);
        return [item, error.into_compile_error()].into_iter().collect();
    };
    let mut errors = Vec::new();
    let expanded = args::parse(attr, &mut errors)
        .and_then(|args| expand::expand(&args, function.clone(), &mut errors));
    // On any error: the original function, plus every error at once.
    expanded.unwrap_or_else(|| {
        let mut out = expand::fallback(function);
        out.extend(errors.into_iter().map(Error::into_compile_error));
        out
    })
}

/// `a`, `b`, `c`: names as the error messages list them.
fn code_list(names: impl IntoIterator<Item = impl std::fmt::Display>) -> String {
    let quoted: Vec<String> = names.into_iter().map(|name| format!("`{name}`")).collect();
    quoted.join(", ")
}
