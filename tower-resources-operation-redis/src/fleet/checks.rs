//! What a member checks of the fleet against its own settings, once, and says if they differ:
//! the capacity it was built with, and whether it is adaptive as the fleet is.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tokio::sync::OnceCell;

use super::books::lock;
use crate::error::Error;
use crate::log::warn;

/// What a member has checked and said of the fleet.
#[derive(Debug, Default)]
pub(crate) struct Checks {
    /// Set once the member's capacity was made the fleet's (built with `overwrite_capacity`).
    overwritten: OnceCell<()>,
    /// Whether the first capacity read from the store was compared with the configured one.
    capacity: AtomicBool,
    /// Whether a fixed replica in an adaptive fleet was said.
    control: AtomicBool,
    /// Held while a first reading is compared and said.
    saying: Mutex<()>,
}

/// What the checks compare and name: the member as it was built, and its store.
pub(crate) struct Built<'a> {
    pub(crate) name: &'a str,
    /// The capacity it was built with.
    pub(crate) capacity: usize,
    /// Whether it was built adaptive.
    pub(crate) adaptive: bool,
    pub(crate) address: &'a str,
}

impl Checks {
    /// First, once, makes the configured capacity the fleet's with `overwrite`, if the limit
    /// was built to.
    pub(crate) async fn overwrite_once(
        &self,
        built_to: bool,
        overwrite: impl Future<Output = Result<(), Error>>,
    ) -> Result<(), Error> {
        if !built_to || self.overwritten.initialized() {
            return Ok(());
        }
        self.overwritten
            .get_or_try_init(|| overwrite)
            .await
            .map(drop)
    }

    /// What the caller sets is the fleet's from now on: neither compared nor overwritten.
    pub(crate) fn capacity_set_here(&self) {
        self.capacity.store(true, Ordering::Relaxed);
        let _ = self.overwritten.set(());
    }

    /// The fleet's capacity, as a call returned it. The first one read is compared with the
    /// configured one: a difference is said once (the fleet's is kept).
    pub(crate) fn read_capacity(&self, capacity: usize, built: &Built<'_>) {
        if self.capacity.load(Ordering::Acquire) {
            return;
        }
        // Under a lock, so that a caller that finds it checked finds it said too (`ready`
        // returns after the warning, whichever call made it).
        let _said = lock(&self.saying);
        if self.capacity.load(Ordering::Acquire) {
            return;
        }
        // Marked once said (a caller that finds it marked finds it said).
        let _mark = Mark(&self.capacity);
        if capacity == built.capacity || built.adaptive {
            return;
        }
        warn(&format!(
            "the fleet limit {:?} was built with a capacity of {}, but the fleet's capacity \
             stored at {} is {capacity}: it keeps the fleet's ({capacity}). The first process \
             to reach the store stores its capacity, and `set_capacity` changes it for the whole \
             fleet; build with `overwrite_capacity()` to make {} the fleet's at this process's \
             first call.",
            built.name, built.capacity, built.address, built.capacity,
        ));
    }

    /// Says, once, that this replica has a fixed capacity in a fleet whose capacity a
    /// controller sets. (The other way round cannot be told from a fleet that starts: its first
    /// adaptive replicas find no controller either.)
    pub(crate) fn check_control(&self, fleet_adaptive: bool, built: &Built<'_>) {
        if built.adaptive || !fleet_adaptive {
            return;
        }
        let _said = lock(&self.saying);
        if self.control.load(Ordering::Acquire) {
            return;
        }
        let _mark = Mark(&self.control);
        warn(&format!(
            "the fleet limit {:?} on {}: this replica has a fixed capacity, but a controller \
             sets the fleet's (an adaptive replica ticked within a lease TTL): this replica \
             admits whatever capacity the controller sets, and never changes it. Build every \
             replica of one limit the same way: all `adaptive(..)`, or none",
            built.name, built.address
        ));
    }
}

/// Sets its flag when dropped: after what it marks is done, however that ends.
struct Mark<'a>(&'a AtomicBool);

impl Drop for Mark<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}
