//! Where code that is not the request's own runs: user code (a classifier, a deadline reader, a
//! chooser, an adaptive algorithm, a meter) and the SDK's records and clock reads. A panic there
//! costs what that code would have returned, never the request that ran it.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `code`; `None` if it panicked.
#[inline]
pub(crate) fn guarded<T>(code: impl FnOnce() -> T) -> Option<T> {
    catch_unwind(AssertUnwindSafe(code)).ok()
}
