//! What every feature's statements are made of: a statement with its values ([`Bound`]), the
//! rows it returns (`row`), the template engine that renders it per flavour (`render`), the
//! names it splices in ([`names`]), and the flavours themselves (`flavour`).

pub(crate) mod bound;
pub(crate) mod flavour;
pub mod names;
pub(crate) mod render;
pub(crate) mod row;
