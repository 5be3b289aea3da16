//! [`guarded`]: the one place where this crate runs code it does not own (an adaptive limit's
//! `Algorithm`) so that a panic in it costs only that call's answer.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// `run()`, or `None` if it panicked. The algorithm's state after a panic is whatever the
/// panic left: the caller keeps the capacity as it was, and the next window asks again. The
/// default panic hook has printed the panic by then, so nothing is said here.
pub(crate) fn guarded<T>(run: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(run)).ok()
}
