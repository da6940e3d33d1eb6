//! The bytes in flight that all listeners share (`--max-inflight-body-bytes`), one permit a KiB:
//! request bodies and gRPC messages as they arrive (what a client has sent, not what it says it
//! will send: stating a large body and trickling it holds only the bytes sent), shared-memory inputs while their tensors live,
//! and large answers until their clients have taken them. A request holds them within its share
//! too (half the budget; `auth::share`), its tenant's, so one tenant's bytes (large bodies sent
//! slowly, large answers it never reads) cannot leave another's requests none; where tenants are
//! configured, requests acting for none (naming none, or a name their token does not bind them
//! to) hold theirs in one share of their own. The share is the caller's (`Acting::share`): the
//! budget keys by what it is given.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use ferrite_core::Error;
use tokio::sync::Semaphore;

// The share of requests acting for no tenant of their own where tenants are configured (`auth::share`).
use crate::auth::OTHERS;

/// See the module.
#[derive(Debug)]
pub struct Budget {
    all: Semaphore,
    /// Permits all requests may hold at once.
    capacity: u32,
    /// Permits one tenant may hold at once.
    share: u32,
    /// Permits each tenant holds now (only those holding any: at most one entry a request).
    tenants: Mutex<HashMap<String, u32>>,
    /// Told when permits are given back (one waiter a time: see `freed`).
    freed: Arc<tokio::sync::Notify>,
}

/// What bytes are held for (`Budget::refusal`).
#[derive(Clone, Copy, Debug)]
pub enum HeldFor {
    /// A request's bytes and what they decode to, until it is answered.
    Request,
    /// Its answer's, until its client has taken them.
    Answer,
}

/// Permits of a budget taken for one tenant (or none), given back when dropped.
pub struct Reserved {
    budget: Arc<Budget>,
    tenant: Option<String>,
    permits: u32,
}

impl Budget {
    /// A budget of `bytes`; a share holds at most half of it.
    pub fn new(bytes: usize) -> Arc<Budget> {
        let permits = u32::try_from(bytes.div_ceil(1024).min(Semaphore::MAX_PERMITS)).unwrap_or(u32::MAX);
        Arc::new(Budget {
            all: Semaphore::new(permits as usize),
            capacity: permits,
            share: permits / 2,
            tenants: Mutex::default(),
            freed: Arc::default(),
        })
    }

    /// The permits no request holds now.
    pub fn available(&self) -> usize {
        self.all.available_permits()
    }

    /// Whether `bytes` more for `tenant` would fit now, beside what every request holds (taking
    /// nothing: a body stated larger than this is refused before any of it is read).
    pub fn fits(&self, tenant: Option<&str>, bytes: usize) -> bool {
        let want = permits(bytes);
        if want as usize > self.available() {
            return false;
        }
        let Some(tenant) = tenant else { return true };
        let holds = self.tenants.lock().unwrap_or_else(|e| e.into_inner()).get(tenant).copied().unwrap_or(0);
        holds.saturating_add(want) <= self.share
    }

    /// Why `bytes` for one request of `tenant` (or its answer) are refused: to retry shortly when
    /// others are answered, or never to be retried when they are more than the budget (or a
    /// tenant's share) could ever hold at once.
    pub fn refusal(&self, tenant: Option<&str>, bytes: usize, held: HeldFor) -> Error {
        let (most, whose) = match tenant {
            Some(OTHERS) => (self.share, "requests acting for no tenant of their own"),
            Some(_) => (self.share, "one tenant's requests"),
            None => (self.capacity, "all requests"),
        };
        let (retry, what, until) = match held {
            HeldFor::Request => (
                crate::http::BODIES_OVER_BUDGET,
                "this request holds",
                "while it is served (its bytes and what they decode to)",
            ),
            HeldFor::Answer => (crate::http::ANSWERS_OVER_BUDGET, "this request's answer holds", "until it is taken"),
        };
        if permits(bytes) <= most {
            return Error::unavailable(retry, Some(ferrite_core::wire::RETRY_AFTER));
        }
        let most = most as usize * 1024;
        Error::TooLarge(format!(
            "{what} {bytes} bytes {until}, more than this server ever holds for {whose} at once ({most} bytes)"
        ))
    }

    /// Takes `permits` more for `tenant`, unless the budget, or the tenant's share, cannot spare
    /// them.
    pub(crate) fn try_take(&self, tenant: Option<&str>, permits: u32) -> bool {
        let Some(tenant) = tenant else {
            return self.all.try_acquire_many(permits).map(|p| p.forget()).is_ok();
        };
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let holds = tenants.get(tenant).copied().unwrap_or(0);
        if holds.saturating_add(permits) > self.share || self.all.try_acquire_many(permits).map(|p| p.forget()).is_err()
        {
            return false;
        }
        *tenants.entry(tenant.to_string()).or_insert(0) += permits;
        true
    }

    /// Gives back `permits` that `tenant` took.
    pub(crate) fn give(&self, tenant: Option<&str>, permits: u32) {
        if permits == 0 {
            return;
        }
        if let Some(tenant) = tenant {
            let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(holds) = tenants.get_mut(tenant) {
                *holds = holds.saturating_sub(permits);
                if *holds == 0 {
                    tenants.remove(tenant);
                }
            }
        }
        self.all.add_permits(permits as usize);
        self.freed.notify_one();
    }

    /// Ready once permits are given back after it is enabled (or first polled); whoever waits for
    /// room enables it before trying once more, so that none given back between is missed. Each
    /// return wakes one waiter, the longest waiting (a wake for each of thousands of waiters at
    /// each return would be a client's to multiply), so waiters also try again now and then.
    pub fn freed(&self) -> tokio::sync::futures::OwnedNotified {
        self.freed.clone().notified_owned()
    }

    /// `bytes` taken for `tenant`, held until dropped; `None` past the budget or its share.
    pub fn take(self: &Arc<Self>, tenant: Option<&str>, bytes: usize) -> Option<Reserved> {
        let mut held = Reserved { budget: self.clone(), tenant: tenant.map(str::to_string), permits: 0 };
        held.grow(bytes).then_some(held)
    }

    /// `permits` already taken for `tenant` (`try_take`), held from now until dropped.
    pub(crate) fn taken(self: &Arc<Self>, tenant: Option<&str>, permits: u32) -> Reserved {
        Reserved { budget: self.clone(), tenant: tenant.map(str::to_string), permits }
    }
}

impl Reserved {
    /// Holds `bytes` in all (never less than held already), or nothing more if the budget, or
    /// the tenant's share, cannot spare the rest.
    pub fn grow(&mut self, bytes: usize) -> bool {
        let want = permits(bytes);
        if want <= self.permits {
            return true;
        }
        let taken = self.budget.try_take(self.tenant.as_deref(), want - self.permits);
        if taken {
            self.permits = want;
        }
        taken
    }

    /// [`Reserved::grow`], or why not ([`Budget::refusal`]).
    pub fn hold(&mut self, bytes: usize, held: HeldFor) -> Result<(), Error> {
        match self.grow(bytes) {
            true => Ok(()),
            false => Err(self.budget.refusal(self.tenant.as_deref(), bytes, held)),
        }
    }

    /// Whether nothing is held (an empty body, and an empty answer).
    pub fn is_empty(&self) -> bool {
        self.permits == 0
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.budget.give(self.tenant.as_deref(), self.permits);
    }
}

/// `bytes` that keep `held` for as long as any of them exists: an answer's bytes handed to hyper
/// (or h2) are kept in its buffers until written to the client, however long that takes, and
/// dropped then (or with the connection); its body may be long gone by then.
pub fn holding<T: Send + 'static>(bytes: Bytes, held: T) -> Bytes {
    Bytes::from_owner(Holding(bytes, held))
}

struct Holding<T>(Bytes, T);

impl<T> AsRef<[u8]> for Holding<T> {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// The permits (one a KiB) that `bytes` take.
pub fn permits(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_holds_half_the_budget_at_most_and_gives_it_back() {
        let budget = Budget::new(8 << 10); // 8 permits, 4 a tenant
        let a = budget.take(Some("a"), 3 << 10).unwrap();
        assert!(budget.take(Some("a"), 2 << 10).is_none(), "past a's share");
        let mut b = budget.take(Some("b"), 1 << 10).unwrap();
        assert!(b.grow(4 << 10) && !b.grow(5 << 10), "b's share is its own");
        assert_eq!(budget.available(), 1);
        assert!(budget.take(None, 2 << 10).is_none(), "past the whole budget");
        let anonymous = budget.take(None, 1 << 10).unwrap();
        drop((a, b));
        assert_eq!(budget.available(), 7);
        assert!(budget.tenants.lock().unwrap().is_empty(), "tenants holding nothing are forgotten");
        // Refused for want of the whole budget, not the share: the share is not charged.
        let c = budget.take(Some("c"), 4 << 10).unwrap();
        assert!(budget.take(Some("d"), 4 << 10).is_none());
        assert_eq!(budget.tenants.lock().unwrap().get("d"), None);
        drop((c, anonymous));
        assert_eq!(budget.available(), 8);
    }

    #[test]
    fn where_tenants_are_configured_requests_for_none_hold_a_share_of_their_own() {
        // Where tenants are configured, such requests come with the others' share (`auth::share`).
        let budget = Budget::new(8 << 10); // 8 permits, 4 a share
        let others = Some(OTHERS);
        let mut none = budget.take(others, 3 << 10).unwrap();
        assert!(!none.grow(5 << 10) && budget.take(others, 2 << 10).is_none(), "past their share");
        assert!(budget.fits(others, 1 << 10) && !budget.fits(others, 2 << 10));
        let a = budget.take(Some("a"), 4 << 10).unwrap();
        let refused = budget.refusal(others, 5 << 10, HeldFor::Request).to_string();
        assert!(refused.contains("for requests acting for no tenant of their own at once (4096 bytes)"), "{refused}");
        drop((a, none));
        assert_eq!(budget.available(), 8);
        assert!(budget.tenants.lock().unwrap().is_empty(), "their share is forgotten when it holds nothing");
    }

    #[test]
    fn what_fits_is_told_without_taking_it() {
        let budget = Budget::new(8 << 10);
        let _a = budget.take(Some("a"), 3 << 10).unwrap();
        assert!(budget.fits(Some("a"), 1 << 10) && !budget.fits(Some("a"), 2 << 10), "a's share");
        assert!(budget.fits(Some("b"), 4 << 10) && !budget.fits(Some("b"), 5 << 10));
        assert!(budget.fits(None, 5 << 10) && !budget.fits(None, 6 << 10), "the whole budget");
        assert_eq!(budget.available(), 5, "nothing taken");
    }

    #[test]
    fn a_request_past_all_it_could_ever_hold_is_refused_for_good() {
        let budget = Budget::new(8 << 10);
        let _others = budget.take(None, 6 << 10).unwrap();
        let retry = |e: Error| matches!(e, Error::Unavailable { retry_after: Some(_), .. });
        assert!(retry(budget.refusal(None, 8 << 10, HeldFor::Request)), "all of it, once the others are answered");
        assert!(retry(budget.refusal(Some("a"), 4 << 10, HeldFor::Request)), "a tenant's share");
        let never = budget.refusal(None, (8 << 10) + 1, HeldFor::Request);
        assert!(matches!(&never, Error::TooLarge(m) if m.contains("all requests at once (8192 bytes)")), "{never:?}");
        let never = budget.refusal(Some("a"), (4 << 10) + 1, HeldFor::Request);
        assert!(
            matches!(&never, Error::TooLarge(m) if m.contains("one tenant's requests at once (4096 bytes)")),
            "{never:?}"
        );
        let never = budget.refusal(Some("a"), (4 << 10) + 1, HeldFor::Answer);
        assert!(
            matches!(&never, Error::TooLarge(m) if m.starts_with("this request's answer holds 4097 bytes")),
            "{never:?}"
        );
        assert!(retry(budget.refusal(None, 1, HeldFor::Answer)));
        let mut held = budget.take(Some("b"), 0).unwrap();
        assert!(
            retry(held.hold(3 << 10, HeldFor::Request).unwrap_err())
                && matches!(held.hold(5 << 10, HeldFor::Request), Err(Error::TooLarge(_)))
        );
        assert!(held.is_empty(), "nothing taken");
    }

    #[test]
    fn bytes_holding_a_reservation_give_it_back_with_their_last_slice() {
        let budget = Budget::new(8 << 10);
        let bytes = holding(Bytes::from(vec![7u8; 4096]), Arc::new(budget.take(None, 4096).unwrap()));
        let mut rest = bytes.clone();
        let head = rest.split_to(1000);
        drop(bytes);
        drop(head);
        assert_eq!(budget.available(), 4, "held while a slice is left");
        assert_eq!(rest.len(), 3096);
        drop(rest);
        assert_eq!(budget.available(), 8);
    }
}
