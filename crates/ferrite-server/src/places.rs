//! Places of work that only a few requests may do at once (decoding large bodies, decompressing
//! them), shared as the bytes in flight are (`budget`, in the same shares: `auth::share`): a share
//! holds at most half of them (at least one), and its requests past that wait in a queue of their
//! own before they join the queue of all. One tenant's flood then queues behind itself: another
//! tenant's request waits for the work in progress, not for the flood (a body of 64 MiB of JSON in
//! 65 KB of gzip holds a decompression place for about half a second; sixteen at once kept another
//! tenant's gzip requests waiting 9 s in one queue of all). Where tenants are configured, requests
//! acting for none of them (naming none, or a made-up name) are one share; they took every place
//! before, and those with made-up names, each a share of its own, every place and the queue of all.
//! Without a config, requests acting for no tenant may take every place, but past those they wait
//! in a queue of their own too.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// See the module.
pub struct Places {
    all: Arc<Semaphore>,
    /// Places one tenant may hold at once.
    share: usize,
    /// The queue of requests acting for no tenant, as many as there are places: past those, they
    /// wait here, not in front of tenants' requests.
    anonymous: Arc<Semaphore>,
    /// Each tenant's own queue, while any of its requests holds or awaits a place.
    tenants: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// A place taken (`Places::take`), given back when dropped. (Neither semaphore is ever closed:
/// the permits are always there.)
pub struct Place {
    _all: Option<OwnedSemaphorePermit>,
    _own: Own,
}

/// A request's place in its own queue (its tenant's, or that of no tenant's); a tenant's queue is
/// forgotten with the last of them.
struct Own {
    places: &'static Places,
    tenant: Option<String>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Places {
    /// `n` places (at least one), a tenant's share half of them (at least one).
    pub fn new(n: usize) -> Places {
        let n = n.max(1);
        Places {
            all: Arc::new(Semaphore::new(n)),
            share: (n / 2).max(1),
            anonymous: Arc::new(Semaphore::new(n)),
            tenants: Mutex::default(),
        }
    }

    /// A place for a request of `tenant`'s share (`auth::share`), once its turn comes: first in
    /// its own queue, then among all.
    pub async fn take(&'static self, tenant: Option<&str>) -> Place {
        let queue = match tenant {
            None => self.anonymous.clone(),
            Some(tenant) => self
                .tenants
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(tenant.to_string())
                .or_insert_with(|| Arc::new(Semaphore::new(self.share)))
                .clone(),
        };
        // Held from here, so a request whose client leaves while it waits forgets its tenant's
        // queue all the same.
        let mut own = Own { places: self, tenant: tenant.map(str::to_string), permit: None };
        own.permit = queue.acquire_owned().await.ok();
        Place { _all: self.all.clone().acquire_owned().await.ok(), _own: own }
    }
}

impl Drop for Own {
    fn drop(&mut self) {
        drop(self.permit.take());
        let Some(tenant) = &self.tenant else { return };
        let mut tenants = self.places.tenants.lock().unwrap_or_else(|e| e.into_inner());
        // Only the map holds it: none of the tenant's requests holds or awaits a place.
        if tenants.get(tenant).is_some_and(|q| Arc::strong_count(q) == 1) {
            tenants.remove(tenant);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn leaked(n: usize) -> &'static Places {
        Box::leak(Box::new(Places::new(n)))
    }

    async fn taken_soon(places: &'static Places, tenant: Option<&str>) -> Option<Place> {
        tokio::time::timeout(Duration::from_millis(50), places.take(tenant)).await.ok()
    }

    #[tokio::test]
    async fn a_tenants_flood_waits_behind_itself_not_in_front_of_others() {
        let places = leaked(2);
        let a1 = taken_soon(places, Some("a")).await.unwrap();
        // a's second request waits for a's first, outside the queue of all.
        let waiting_a = tokio::spawn(places.take(Some("a")));
        let waiting_a2 = tokio::spawn(places.take(Some("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting_a.is_finished() && !waiting_a2.is_finished());
        assert_eq!(places.all.available_permits(), 1, "a's second waits outside the queue of all");
        let b = taken_soon(places, Some("b")).await.expect("b's turn does not come after a's queue");
        assert_eq!(places.tenants.lock().unwrap().len(), 2);
        // All places held: b's next waits for one, and gets the first given back after a's.
        let waiting_b = tokio::spawn(places.take(Some("b")));
        drop(a1);
        let a2 = waiting_a.await.unwrap();
        drop(b);
        let b2 = waiting_b.await.unwrap();
        assert!(!waiting_a2.is_finished());
        drop((a2, b2));
        drop(waiting_a2.await.unwrap());
        assert!(places.tenants.lock().unwrap().is_empty(), "tenants holding nothing are forgotten");
        assert_eq!(places.all.available_permits(), 2);
    }

    #[tokio::test]
    async fn requests_for_no_tenant_take_every_place_and_queue_behind_their_own() {
        let places = leaked(2);
        let (x, y) = (taken_soon(places, None).await.unwrap(), taken_soon(places, None).await.unwrap());
        let waiting = [tokio::spawn(places.take(None)), tokio::spawn(places.take(None))];
        // A tenant's request waiting among all, then dropped (its client left): forgotten.
        assert!(taken_soon(places, Some("a")).await.is_none());
        assert!(places.tenants.lock().unwrap().is_empty());
        // The next place given back goes to a tenant's request that came after the anonymous
        // ones, which wait in their own queue.
        let a = tokio::spawn(places.take(Some("a")));
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(x);
        let a = a.await.unwrap();
        assert!(waiting.iter().all(|w| !w.is_finished()));
        drop((a, y));
        for w in waiting {
            drop(w.await.unwrap());
        }
        assert_eq!(places.all.available_permits(), 2);
        // One place: a tenant's share is still one.
        let one = leaked(1);
        drop(taken_soon(one, Some("a")).await.unwrap());
        assert_eq!(one.share, 1);
    }
}
