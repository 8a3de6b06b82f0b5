//! `#[derive(StateMachine)]` and `transition!`: declarations and their compile-time check.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, Ident, Path, Token};

/// `A -> B` inside `#[transitions(...)]` or `transition!(Type: A -> B)`.
struct Edge {
    from: Ident,
    to: Ident,
}

impl Parse for Edge {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let from = input.parse()?;
        input.parse::<Token![->]>()?;
        let to = input.parse()?;
        Ok(Self { from, to })
    }
}

/// Input:
/// ```text
/// #[derive(StateMachine)]
/// #[transitions(Pending -> Paid, Paid -> Shipped)]
/// enum OrderStatus { Pending, Paid, Shipped }
/// ```
/// Output: `impl idem::StateMachine for OrderStatus` (states, transitions, names) and
/// inherent `const fn can_transition`, `transitions()` and `to_mermaid()`.
pub(crate) fn derive(input: &DeriveInput) -> syn::Result<TokenStream> {
    let Data::Enum(data) = &input.data else {
        let message = "`StateMachine` derives on an enum of states (unit variants)";
        return Err(syn::Error::new(input.ident.span(), message));
    };
    let mut errors = Vec::new();
    let mut error = |span: Span, message: &str| errors.push(syn::Error::new(span, message));
    for fields in data.variants.iter().map(|v| &v.fields) {
        if !matches!(fields, Fields::Unit) {
            let message = "states are unit variants: move the data into the row, not the state";
            error(fields.span(), message);
        }
    }
    let variants: Vec<&Ident> = data.variants.iter().map(|v| &v.ident).collect();
    let listing = crate::code_list(&variants);

    let (mut edges, mut declared, mut krate) = (Vec::<Edge>::new(), false, None::<Path>);
    for attr in &input.attrs {
        if attr.path().is_ident("transitions") {
            declared = true;
            let parsed = attr.parse_args_with(Punctuated::<Edge, Token![,]>::parse_terminated)?;
            edges.extend(parsed);
        } else if attr.path().is_ident("state_machine") {
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("crate") {
                    let lit: syn::LitStr = meta.value()?.parse()?;
                    krate = Some(lit.parse()?);
                    Ok(())
                } else {
                    Err(meta.error("unknown `state_machine` option; expected `crate = \"...\"`"))
                }
            })?;
        }
    }
    if !declared {
        let message = "declare the transitions: `#[transitions(Pending -> Paid, Paid -> Shipped)]`";
        error(input.ident.span(), message);
    }
    let name = &input.ident;
    for (i, Edge { from, to }) in edges.iter().enumerate() {
        for end in [from, to] {
            if !variants.contains(&end) {
                let message = format!("`{end}` is not a state of `{name}`; states are {listing}");
                error(end.span(), &message);
            }
        }
        if from == to {
            let why = "applying a transition to a row already in its target state is always `AlreadyApplied`";
            error(
                to.span(),
                &format!("`{from} -> {from}` needs no declaration: {why}; remove it"),
            );
        }
        if edges[..i].iter().any(|e| e.from == *from && e.to == *to) {
            error(
                from.span(),
                &format!("`{from} -> {to}` is declared twice; remove one"),
            );
        }
    }
    let mut errors = errors.into_iter();
    if let Some(mut all) = errors.next() {
        all.extend(errors);
        return Err(all);
    }

    let krate = krate.map_or_else(|| quote!(::idem), |p| quote!(#p));
    let vis = &input.vis;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let names = variants.iter().map(|v| v.to_string());
    let pairs: Vec<TokenStream> = edges
        .iter()
        .map(|Edge { from, to }| quote!((Self::#from, Self::#to)))
        .collect();
    let indices = edges
        .iter()
        .map(|Edge { from, to }| quote!((Self::#from as i128, Self::#to as i128)));
    Ok(quote! {
        impl #impl_generics #krate::StateMachine for #name #ty_generics #where_clause {
            const STATES: &'static [Self] = &[#(Self::#variants),*];
            const TRANSITIONS: &'static [(Self, Self)] = &[#(#pairs),*];
            const DECLARED: &'static [(i128, i128)] = &[#(#indices),*];
            fn name(self) -> &'static str {
                match self {
                    #(Self::#variants => #names,)*
                }
            }
        }

        impl #impl_generics #name #ty_generics #where_clause {
            /// Whether the transition `from -> to` is declared (usable in `const` contexts).
            #[allow(dead_code)]
            #vis const fn can_transition(from: Self, to: Self) -> bool {
                #krate::__private::declared::<Self>(from as i128, to as i128)
            }

            /// Every declared `(from, to)` transition.
            #[allow(dead_code)]
            #vis const fn transitions() -> &'static [(Self, Self)] {
                <Self as #krate::StateMachine>::TRANSITIONS
            }

            /// The state diagram as Mermaid `stateDiagram-v2` text.
            #[allow(dead_code)]
            #vis fn to_mermaid() -> ::std::string::String {
                <Self as #krate::StateMachine>::mermaid()
            }
        }
    })
}

/// Input: `transition!(OrderStatus: Pending -> Paid)`.
/// Output: a block with a `const` assertion (spanned at `Pending -> Paid`, so an undeclared
/// transition is a compile error there) whose value is the checked `idem::Transition`.
pub(crate) fn transition(input: ParseStream<'_>) -> syn::Result<TokenStream> {
    let ty: Path = input.parse()?;
    input.parse::<Token![:]>()?;
    let Edge { from, to } = input.parse()?;
    let span = from.span().join(to.span()).unwrap_or_else(|| from.span());
    let type_name = quote!(#ty).to_string().replace(' ', "");
    let fix = "add it to `#[transitions(...)]` or use a declared one";
    let message = format!("transition `{from} -> {to}` is not declared on `{type_name}`; {fix}");
    // The check also requires `#ty: StateMachine`: a type that is none is one error, on `#ty`.
    let declared = quote_spanned! {ty.span()=> ::idem::__private::declared::<#ty> };
    let check = quote_spanned! {span=>
        const _: () = ::core::assert!(#declared(#ty::#from as i128, #ty::#to as i128), #message);
    };
    let value = quote_spanned! {ty.span()=>
        ::idem::Transition::<#ty>::checked(#ty::#from, #ty::#to)
    };
    Ok(quote! {{
        #check
        #value
    }})
}
