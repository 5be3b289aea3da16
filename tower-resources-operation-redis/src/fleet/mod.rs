//! What makes one limit of many processes, whatever store keeps it: each process's part
//! ([`member`]), its books and ids ([`books`]), how an operation takes a place ([`waiter`]) and
//! holds it ([`place`]), whether the store is reached ([`health`]), the background work
//! ([`background`]), an adaptive limit's controller ([`control`]), all written once against
//! the [`store::Store`] seam. Nothing here knows Redis: the Redis store (`crate::redis_store`)
//! implements the seam, and imports from here, never the other way round.

pub(crate) mod background;
pub(crate) mod books;
pub(crate) mod checks;
pub(crate) mod control;
pub(crate) mod doorbell;
pub(crate) mod health;
pub(crate) mod member;
pub(crate) mod place;
pub(crate) mod share;
pub(crate) mod store;
pub(crate) mod waiter;
