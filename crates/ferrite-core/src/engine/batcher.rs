//! The dynamic batcher: one queue per model, drained by one OS thread per model instance.
//!
//! A free instance takes the next batch the queue's policy allows, runs it on its own thread
//! (never the async runtime's), and splits the outputs back to each request.
//!
//! A model served by single-threaded instances (one per core, what the calibration picks for
//! conv nets under load) may also have a *solo* instance whose threads span the whole budget: it
//! takes the work when one batch holds all of it and nothing else runs (a lone client then gets the
//! latency of every core, not one), and the single-threaded ones take it when there is more than
//! one batch of work. The two kinds never run at once, so the threads running never exceed the
//! budget.
//!
//! A backend whose requests may be heavy (`Backend::cost`: a pipeline's large images or long
//! texts) has one more worker, the *reserve*: its instances may all run heavy batches, and the
//! reserve takes light work only while they do, so a light request never waits for a heavy one
//! to finish, and heavy work alone still has every instance.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Condvar, Mutex, MutexGuard,
    },
    task::{Context, Waker},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{
    engine::{
        backend::{Abandon, BatchInput, Instance, Live},
        costs::{self, BatchCosts, BatchTime, Bounds, Explore},
        queue::{Decision, Pending, Queue},
        spec::{reshaped, ModelSpec, TimeoutAction},
    },
    telemetry::{metrics::ModelMetrics, stats::ModelStats},
    wire::RETRY_AFTER,
    Backend, Error, Result, Tensor,
};

/// How long a quick model's idle worker (see `WATCH_BELOW`) watches for the next request before
/// sleeping on the condvar, at least.
/// Waking a sleeping thread costs tens of microseconds on a VM; a request arriving within this
/// window is picked up without that wake-up (see the `roundtrip` example).
const IDLE_SPIN: Duration = Duration::from_micros(50);
/// The longest it watches: a lone client's next request comes one round trip after its answer
/// (150-300 µs here over HTTP or gRPC), longer than `IDLE_SPIN`, so it is watched for twice the
/// recent gaps up to this, yielding the core after the first `IDLE_SPIN` (see `idle_spin`).
const IDLE_SPIN_MAX: Duration = Duration::from_micros(500);
/// Batches of one request in a row before the watch grows past `IDLE_SPIN`: one client's. Under
/// many clients whose I/O keeps the cores busy, a lone batch comes now and then, and watching
/// longer there took the I/O threads' CPU (gRPC at 128 clients lost a tenth of its requests).
const LONE_STREAK: u32 = 8;
/// No watch at all for a model whose batches take longer than this: the wake-up it saves is then a
/// small share of a request, and it holds a core just when the answer's delivery and the caller's
/// next request need one. Watching longer, a ResNet-style model answered one client 0.1-0.9 ms
/// later; watching `IDLE_SPIN`, the text pipeline and its encoder (1.8-1.9 ms a batch) answered
/// one client with a p99 of 4-5 ms against 2.2-2.8 ms without (`bench/results/watch-slow-ab.md`).
/// A quick model's lone client is where a wake-up weighs (the MLP: 0.3 ms a run).
const WATCH_BELOW: Duration = Duration::from_millis(1);

/// How long to watch for the next request, given the moving average of recent gaps between a
/// lone request's answer and the next request: twice that, within [`IDLE_SPIN`, `IDLE_SPIN_MAX`],
/// while the gaps are within `IDLE_SPIN_MAX`; `IDLE_SPIN` when they are longer (a model called now
/// and then, whose next request no watching would catch).
fn idle_spin(recent_gap: Duration) -> Duration {
    if recent_gap <= IDLE_SPIN_MAX {
        (recent_gap * 2).clamp(IDLE_SPIN, IDLE_SPIN_MAX)
    } else {
        IDLE_SPIN
    }
}

/// How long an idle worker watches for the next request after `lone_streak` batches of one request
/// in a row, the model's batches taking `batch_time` and the next request coming `recent_gap` after
/// the answer: only for a quick model (see `WATCH_BELOW`), and longer than [`IDLE_SPIN`] only for
/// its lone client (see `LONE_STREAK`).
fn watch_for(lone_streak: u32, batch_time: Duration, recent_gap: Duration) -> Duration {
    if batch_time > WATCH_BELOW {
        Duration::ZERO
    } else if lone_streak >= LONE_STREAK {
        idle_spin(recent_gap)
    } else {
        IDLE_SPIN
    }
}

/// Watches `submitted` move past `seen` for `spin`: busy for the first [`IDLE_SPIN`], then
/// yielding the core between looks (to the I/O threads, which may share it). A function of its
/// own so that a profile can tell this wait from the work around it (`bench/instructions.py` leaves
/// it out).
#[inline(never)]
fn spin_for_next(submitted: &std::sync::atomic::AtomicU64, seen: u64, spin: Duration) {
    let start = Instant::now();
    let busy_until = start + IDLE_SPIN.min(spin);
    let spin_until = start + spin;
    while submitted.load(Ordering::Acquire) == seen {
        let now = Instant::now();
        if now >= spin_until {
            return;
        }
        if now < busy_until {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// The callers of a batch are expected back within this of its end; a batch that forms later is
/// not held for them.
const RETURN_WITHIN: Duration = Duration::from_millis(10);
/// No batch is held for less: a client answered comes back no sooner (150-300 µs on loopback here),
/// so a shorter hold would end empty, and the tiny model's would cost more than its runs.
const HOLD_AT_LEAST: Duration = Duration::from_micros(100);
/// Batches formed without holding after a hold that gained no row (its callers did not come back).
const HOLD_BACKOFF: u32 = 16;

/// A worker's batch held for the callers of the worker's batch before it, when the model's
/// measured costs say one merged run serves them sooner (`BatchCosts::hold`) and the config leaves
/// the queue delay to the server (`BatchPolicy::gather`). Clients that wait for each answer come
/// back as the group that batch answered, while the requests that queued during it run: under 8
/// of perf_analyzer's clients the MLP ran batches of 4 that cost what batches of 8 do (on one
/// instance), or, on two, took a batch of one onto the idle instance for as long as one of 8 takes.
/// While a batch is held, no other worker is woken for its rows (`Shared::holding`).
#[derive(Default)]
struct Gather {
    /// Rows the last batch answered plus those queued when it ended: the rows expected.
    expected: usize,
    /// Those and the rows other instances were running then: more than one batch takes, and the
    /// batches fill without waiting.
    crowd: usize,
    ended: Option<Instant>,
    /// The forming batch's hold, decided once: (rows it held at, until when); `Some(None)`: none.
    hold: Option<Option<(usize, Instant)>>,
    /// Batches left to form without holding (see `HOLD_BACKOFF`).
    backoff: u32,
}

impl Gather {
    fn ended(&mut self, rows: usize, (queued, elsewhere): (usize, usize), now: Instant) {
        self.expected = rows + queued;
        self.crowd = self.expected + elsewhere;
        self.ended = Some(now);
    }

    /// The hold of the batch forming from `q` (`limit` rows at most) at `now`: (rows, until). None
    /// when more rows are about than one batch takes (see `crowd`).
    fn hold(&mut self, costs: &Mutex<BatchCosts>, q: &Queue, limit: usize, now: Instant) -> Option<(usize, Instant)> {
        let rows = q.rows();
        let target = self.expected;
        if self.backoff > 0 || rows == 0 || rows >= target || self.crowd > limit {
            return None;
        }
        let fresh = self.ended.is_some_and(|at| now.saturating_duration_since(at) <= RETURN_WITHIN);
        let decided = *self.hold.get_or_insert_with(|| {
            let head = q.head(false).filter(|_| fresh)?;
            let costs = costs.lock().unwrap_or_else(|e| e.into_inner());
            let wait = costs.hold(head.row_elements(), rows, target).filter(|&w| w >= HOLD_AT_LEAST)?;
            Some((rows, now + wait))
        });
        decided.map(|(_, until)| (target, until))
    }

    /// A batch of `rows` formed at `now`.
    fn formed(&mut self, rows: usize, now: Instant) {
        match self.hold.take() {
            Some(Some((held, until))) if now >= until && rows <= held => self.backoff = HOLD_BACKOFF,
            _ => self.backoff = self.backoff.saturating_sub(1),
        }
    }
}

struct Shared {
    /// Bumped on every submit, so a spinning worker sees new work without taking the lock.
    submitted: std::sync::atomic::AtomicU64,
    queue: Mutex<Queue>,
    wake: Wake,
    /// The solo instance's own (see the module), so a submit wakes only the worker whose turn it is.
    wake_solo: Wake,
    /// The reserve's own (see the module).
    wake_reserve: Wake,
    /// The model has a reserve worker.
    has_reserve: bool,
    /// Signalled when a batch finishes or the queue empties, for shutdown's wait.
    idle: Condvar,
    closed: std::sync::atomic::AtomicBool,
    running: AtomicUsize,
    /// Set while the solo instance runs a batch (under the queue lock).
    solo_running: std::sync::atomic::AtomicBool,
    /// The model has a solo instance: workers take turns as the module says.
    has_solo: bool,
    /// Its workers may hold a batch for more rows (see `Gather`).
    gathers: bool,
    /// The rows a held batch waits for (0: none held): a submit wakes a worker only then.
    holding: AtomicUsize,
    /// Rows in the batches running now (for `share` and `Gather`).
    running_rows: AtomicUsize,
    /// The backend answers each request apart (`Backend::answers_each`).
    each: bool,
    /// Batches formed so far (for exploring past the measured merge limit now and then).
    formed: std::sync::atomic::AtomicU64,
    /// Batches of heavy requests running now: at most all instances but one (with a reserve, all
    /// of them), so light work always finds one (see `Pending::heavy`).
    heavy_running: AtomicUsize,
    /// Requests whose clients left after they were taken from the queue: before they ran, or
    /// while they ran in a backend that stopped paying for them (a pipeline).
    cancelled: std::sync::atomic::AtomicU64,
    /// Requests that failed in the backend, warned of a line a second (a client can send many).
    failures: crate::telemetry::quiet::Quiet,
    /// One batch's recent run time, for refusing requests whose deadline cannot be met.
    batch_time: BatchTime,
    /// Run time per element by batch size and size of rows, from which the merge limit follows.
    costs: Mutex<BatchCosts>,
    /// With `preserve_ordering`: batches are numbered as they leave the queue (under its lock),
    /// and each answers only after the one before it has.
    tickets: std::sync::atomic::AtomicU64,
    answered: Mutex<u64>,
    answered_turn: Condvar,
    spec: ModelSpec,
    stats: Arc<ModelStats>,
    metrics: ModelMetrics,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The merge limit the measured costs allow now for the request at the head of `q` (a read:
    /// deciding whose turn work is, or waking up, changes nothing).
    fn limit(&self, q: &Queue) -> usize {
        let Some(head) = q.head(false) else { return self.spec.batch.merge_limit };
        self.costs.lock().unwrap_or_else(|e| e.into_inner()).limit(self.bounds(), head.row_elements())
    }

    /// Where the merge limits start (calibration's, at its size of rows) and how far they go.
    fn bounds(&self) -> Bounds {
        let b = &self.spec.batch;
        Bounds { start: b.merge_limit, at: b.merge_at, max: b.most_rows() }
    }

    /// The merge limit for the next batch formed from `q`: for its head's size, now and then
    /// another size explored (`costs::EXPLORE_EVERY`), and a smaller size not yet measured
    /// learned first (`BatchCosts::batch_limit`).
    fn batch_limit(&self, q: &Queue, light_only: bool) -> usize {
        let Some(head) = q.head(light_only) else { return self.spec.batch.merge_limit };
        let explore = Explore::nth(self.formed.load(Ordering::Relaxed) + 1);
        let costs = self.costs.lock().unwrap_or_else(|e| e.into_inner());
        costs.batch_limit(self.bounds(), head.row_elements(), explore)
    }

    /// Where the workers of `role` sleep.
    fn wake(&self, role: Role) -> &Wake {
        match role {
            Role::Solo => &self.wake_solo,
            Role::Reserve => &self.wake_reserve,
            Role::Shared | Role::Narrow => &self.wake,
        }
    }

    /// The heavy batches that may run at once: all instances but one, so light work always finds
    /// one, or all of them where the reserve is there for light work.
    fn most_heavy(&self) -> usize {
        let n = self.spec.instance_count;
        if self.has_reserve {
            n.max(1)
        } else {
            n.saturating_sub(1).max(1)
        }
    }

    /// The condvar of the workers whose turn the work in `q` is, if any is queued and one of them
    /// sleeps (decided under the queue's lock; notified after it is released, so the woken worker
    /// does not wait on it).
    fn next_turn(&self, q: &Queue) -> Option<&Wake> {
        if q.is_empty() {
            return None;
        }
        let wake = if self.has_reserve && my_turn(self, q, Role::Reserve, 0) {
            &self.wake_reserve
        } else if !self.has_solo {
            &self.wake
        } else {
            let limit = self.limit(q);
            if my_turn(self, q, Role::Solo, limit) {
                &self.wake_solo
            } else if my_turn(self, q, Role::Narrow, limit) {
                &self.wake
            } else {
                return None;
            }
        };
        wake.anyone().then_some(wake)
    }
}

/// A condvar that knows whether a worker sleeps on it. std's `notify_one` enters the kernel even
/// when no one waits, and under load a submit mostly finds the workers busy: that was one futex
/// call per request, a third of the server's system calls (MLP over binary HTTP at 128 clients).
#[derive(Default)]
struct Wake {
    condvar: Condvar,
    /// Workers sleeping on `condvar`; changed and read under the queue's lock only.
    sleeping: AtomicUsize,
}

impl Wake {
    /// Sleeps until notified or `timeout` passes, counted as sleeping meanwhile.
    fn sleep<'a>(&self, q: MutexGuard<'a, Queue>, timeout: Option<Duration>) -> MutexGuard<'a, Queue> {
        self.sleeping.fetch_add(1, Ordering::Relaxed);
        let q = match timeout {
            None => self.condvar.wait(q).unwrap_or_else(|e| e.into_inner()),
            Some(t) => self.condvar.wait_timeout(q, t).unwrap_or_else(|e| e.into_inner()).0,
        };
        self.sleeping.fetch_sub(1, Ordering::Relaxed);
        q
    }

    /// Whether a worker sleeps here (ask under the queue's lock: the count changes only under it).
    fn anyone(&self) -> bool {
        self.sleeping.load(Ordering::Relaxed) > 0
    }

    fn notify_one(&self) {
        self.condvar.notify_one();
    }
}

pub struct Batcher {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Batcher {
    /// Creates `spec.instance_count` instances of `backend` (failing fast) and their threads, and
    /// one more for `solo` when given (see the module).
    pub fn start(
        spec: &ModelSpec,
        backend: &dyn Backend,
        solo: Option<Box<dyn Instance>>,
        stats: Arc<ModelStats>,
        metrics: ModelMetrics,
    ) -> Result<Batcher> {
        let mut instances = (0..spec.instance_count)
            .map(|_| backend.instance().map(|i| (i, Role::Shared)))
            .collect::<Result<Vec<_>>>()?;
        let has_reserve = backend.cost().is_some() && solo.is_none();
        if has_reserve {
            instances.push((backend.instance()?, Role::Reserve));
        }
        let shared = Arc::new(Shared {
            submitted: Default::default(),
            cancelled: Default::default(),
            failures: Default::default(),
            heavy_running: AtomicUsize::new(0),
            formed: Default::default(),
            queue: Mutex::new(Queue::new(&spec.batch.level_queues)),
            batch_time: BatchTime::default(),
            costs: Mutex::default(),
            tickets: Default::default(),
            answered: Mutex::new(0),
            answered_turn: Condvar::new(),
            wake: Wake::default(),
            wake_solo: Wake::default(),
            wake_reserve: Wake::default(),
            has_reserve,
            idle: Condvar::new(),
            closed: Default::default(),
            running: AtomicUsize::new(0),
            solo_running: Default::default(),
            has_solo: solo.is_some(),
            gathers: spec.batch.gather && spec.batch.dynamic && !backend.answers_each(),
            holding: AtomicUsize::new(0),
            running_rows: AtomicUsize::new(0),
            each: backend.answers_each(),
            spec: spec.clone(),
            stats,
            metrics,
        });
        if let Some(solo) = solo {
            for (_, role) in &mut instances {
                *role = Role::Narrow;
            }
            instances.push((solo, Role::Solo));
        }
        let workers = instances
            .into_iter()
            .enumerate()
            .map(|(i, (instance, role))| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("ferrite-{}-{i}", spec.name))
                    .spawn(move || worker(&shared, instance, role))
                    .map_err(|e| Error::internal(format!("cannot start a worker thread: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Batcher { shared, workers: Mutex::new(workers) })
    }

    /// Queues `p`; refuses it when the queue is full, the batcher is closed, or its deadline
    /// cannot be met given the work ahead of it (rather than letting it wait and then fail).
    pub fn submit(&self, p: Pending) -> Result<()> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::unavailable("model is shutting down", Some(RETRY_AFTER)));
        }
        let mut q = self.shared.lock();
        // With nothing queued ahead, a request is always admitted: it runs next, and its run
        // refreshes the estimate (which a model refusing everything would never get otherwise).
        if let Some(deadline) = p.deadline.filter(|_| self.rejects_late(p.level) && q.requests_ahead(p.level) > 0) {
            if let Some(wait) = self.estimate_wait(&mut q, &p) {
                if p.enqueued + wait > deadline {
                    return Err(Error::DeadlineExceeded(format!(
                        "the request's timeout cannot be met: about {} µs of work is ahead of it, {} µs allowed",
                        wait.as_micros(),
                        deadline.saturating_duration_since(p.enqueued).as_micros()
                    )));
                }
            }
        }
        q.push(p)?;
        self.shared.submitted.fetch_add(1, Ordering::Release);
        let next = self.shared.next_turn(&q).filter(|_| q.rows() >= self.shared.holding.load(Ordering::Relaxed));
        drop(q);
        if let Some(c) = next {
            c.notify_one();
        }
        Ok(())
    }

    fn rejects_late(&self, level: usize) -> bool {
        let levels = &self.shared.spec.batch.level_queues;
        levels.get(level).or(levels.last()).is_none_or(|q| q.timeout_action == TimeoutAction::Reject)
    }

    /// A lower bound on how long `p` waits for its answer if queued now: the batches queued ahead
    /// of it (those whose turns come first, where tenants take turns) shared among the
    /// instances, plus its own, at the recent average batch time. `None` before the first batch
    /// has run.
    fn estimate_wait(&self, q: &mut Queue, p: &Pending) -> Option<Duration> {
        // Requests whose clients left, or that expired, are not work ahead.
        q.prune(Instant::now());
        let policy = &self.shared.spec.batch;
        let batches_ahead = if policy.dynamic {
            q.rows_ahead(p.level, &p.share, p.rows).div_ceil(policy.max_batch_size.max(1))
        } else {
            q.requests_ahead(p.level)
        };
        self.shared.batch_time.wait(batches_ahead, self.shared.spec.instance_count)
    }

    pub fn queued(&self) -> usize {
        self.shared.lock().len()
    }

    /// Requests dropped because their client had gone: before running, or (a pipeline) mid-run.
    pub fn cancelled(&self) -> u64 {
        self.shared.lock().cancelled + self.shared.cancelled.load(Ordering::Relaxed)
    }

    /// Batches running now.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Acquire)
    }

    /// Stops taking requests; what is queued still runs. Workers exit once the queue is empty.
    pub fn close(&self) {
        // Under the lock, so a worker between its last check and its wait cannot miss the wake-up.
        let q = self.shared.lock();
        self.shared.closed.store(true, Ordering::Release);
        drop(q);
        self.shared.wake.condvar.notify_all();
        self.shared.wake_solo.condvar.notify_all();
        self.shared.wake_reserve.condvar.notify_all();
    }

    /// Waits until nothing is queued or running, at most until `deadline`. True if drained.
    pub fn wait_idle(&self, deadline: Instant) -> bool {
        let mut q = self.shared.lock();
        loop {
            if q.is_empty() && self.shared.running.load(Ordering::Acquire) == 0 {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            q = self.shared.idle.wait_timeout(q, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Fails every queued request explicitly (after the shutdown deadline).
    pub fn abort(&self) -> usize {
        let drained = self.shared.lock().drain();
        let n = drained.len();
        for p in drained {
            let _ = p.reply.send(Err(Error::unavailable("server shut down before the request ran", None)));
        }
        self.shared.idle.notify_all();
        n
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.close();
        self.abort();
        let me = std::thread::current().id();
        for w in self.workers.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            // A worker that drops its own model (the last reference, which a pipeline's worker can
            // hold) ends by itself once closed; joining it from itself would deadlock.
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

/// What a worker's instance is, for whose turn it is (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The model has no solo instance: every worker takes any work.
    Shared,
    /// A single-threaded instance beside a solo one: takes work when more than one batch of it
    /// is queued, or when another of its kind already runs.
    Narrow,
    /// The instance on every thread of the budget: takes work when one batch holds all of it and
    /// nothing runs.
    Solo,
    /// One more instance of a backend whose requests may be heavy: takes light work only, while
    /// heavy batches run on all the others.
    Reserve,
}

/// Whether `role` may take work from `q` now (always, without a solo instance).
fn my_turn(shared: &Shared, q: &Queue, role: Role, limit: usize) -> bool {
    if role == Role::Shared || q.is_empty() {
        return true;
    }
    if role == Role::Reserve {
        return shared.heavy_running.load(Ordering::Acquire) >= shared.most_heavy() && q.head(true).is_some();
    }
    let running = shared.running.load(Ordering::Acquire);
    // Past calibration's limit (a limit scaled to smaller rows than calibration's), the batch
    // would hold several callers that the single-threaded instances serve side by side sooner: a
    // BERT-style encoder calibrated to 2 rows at sequences of 224, its sentences of 14 tokens
    // allowed 32, ran nearly only on the solo instance at 8 pipeline clients (10% fewer texts a
    // second, p99 18 -> 23 ms).
    let one_batch = q.len() == 1 || (shared.spec.batch.dynamic && q.rows() <= limit.min(shared.spec.batch.merge_limit));
    match role {
        Role::Solo => running == 0 && one_batch,
        _ => !shared.solo_running.load(Ordering::Acquire) && (running > 0 || !one_batch),
    }
}

/// The most rows a batch may take (of `limit`) when `queued` rows wait and the model's other
/// instances run `running`: an equal share of all the work about. Taking all that is queued, one
/// instance ran a long batch while another, free soon after, took the few that came next, batch
/// after batch: one group of clients waited behind the long runs and the short ones cost more per
/// row (the text pipeline's four workers at 32 clients: batches of 1-2 rows beside ones of 20-29,
/// p99 71 ms; in shares, batches of 6-8 and p99 54 ms, 7% fewer texts a second; at 8 clients 20%
/// more, p99 26 -> 16 ms: `bench/results/share-text.md`). Not for the solo instance, which runs
/// alone, nor where the config sets a queue delay (`BatchPolicy::gather`): a batch that reaches its
/// limit runs without waiting, so a share would cut the batches that delay is there to fill.
fn share(limit: usize, queued: usize, running: usize, instances: usize) -> usize {
    if instances <= 1 {
        return limit;
    }
    limit.min((queued + running).div_ceil(instances).max(1))
}

fn worker(shared: &Shared, mut instance: Box<dyn Instance>, role: Role) {
    let mut last_requests = 0;
    // When this worker went idle after a lone request, and the moving average of how long the next
    // request then took to come (see `idle_spin`).
    let mut idle_since = None;
    let mut recent_gap = IDLE_SPIN;
    let mut lone_streak = 0;
    let mut gather = Gather::default();
    let on_caller = instance.runs_on_caller();
    let cpu_now = || on_caller.then(costs::thread_cpu_time);
    loop {
        // This thread's CPU clock before the batch forms, for what its run costs (see `run`). Read
        // here and not as the run starts: on a core shared with the I/O threads, the read is a
        // point where they may take the core, and there they add the requests they were reading
        // to this batch (read as the run started, the MLP's batches under 8 clients fell from 7.6
        // to 6.5 requests and it served 12% fewer).
        let mut cpu_from = cpu_now();
        let batch = {
            let mut q = shared.lock();
            loop {
                let flush = shared.closed.load(Ordering::Acquire);
                if !my_turn(shared, &q, role, shared.limit(&q)) {
                    // The other kind of instance takes this work, or is running: wait for a
                    // submit or a finished batch to change that (the timeout only guards).
                    let turn = Duration::from_millis(50);
                    q = shared.wake(role).sleep(q, Some(turn));
                    continue;
                }
                let light_only =
                    role == Role::Reserve || shared.heavy_running.load(Ordering::Acquire) >= shared.most_heavy();
                let mut limit = shared.batch_limit(&q, light_only);
                // A queue delay the config sets is Triton's: an instance takes what its limit allows.
                if role != Role::Solo && shared.spec.batch.gather {
                    let running = shared.running_rows.load(Ordering::Acquire);
                    limit = share(limit, q.rows(), running, shared.spec.instance_count);
                }
                let now = Instant::now();
                let hold = shared.gathers.then(|| gather.hold(&shared.costs, &q, limit, now)).flatten();
                let decision = q.next_batch_of(now, &shared.spec.batch, limit, flush, light_only, hold);
                match decision {
                    Decision::Run(batch) => {
                        shared.formed.fetch_add(1, Ordering::Relaxed);
                        let rows = batch.iter().map(|p| p.rows).sum();
                        gather.formed(rows, now);
                        if let Some(since) = idle_since.take() {
                            // Weight 1/8, capped, so that one pause of the client's does not end
                            // the watching.
                            let gap = Instant::now().saturating_duration_since(since).min(IDLE_SPIN_MAX * 2);
                            recent_gap = (recent_gap * 7 + gap) / 8;
                        }
                        if batch.iter().any(|p| p.heavy) {
                            shared.heavy_running.fetch_add(1, Ordering::AcqRel);
                        }
                        let ticket = shared.tickets.fetch_add(1, Ordering::AcqRel);
                        shared.running.fetch_add(1, Ordering::AcqRel);
                        shared.solo_running.store(role == Role::Solo, Ordering::Release);
                        // Another free instance may take the rest.
                        if let Some(c) = shared.next_turn(&q) {
                            c.notify_one();
                        }
                        // A lone request that left the queue empty: its backend may poll for
                        // its answer while no other request comes (`Live::alone`).
                        let quiet =
                            (batch.len() == 1 && q.is_empty()).then(|| shared.submitted.load(Ordering::Acquire));
                        let left = shared.gathers.then(|| (q.rows(), shared.submitted.load(Ordering::Acquire)));
                        break (batch, rows, ticket, quiet, left);
                    }
                    Decision::WaitUntil(when) => {
                        let wait = when.saturating_duration_since(Instant::now());
                        shared.holding.store(hold.map_or(0, |(rows, _)| rows), Ordering::Relaxed);
                        q = shared.wake(role).sleep(q, Some(wait));
                        shared.holding.store(0, Ordering::Relaxed);
                    }
                    Decision::Idle => {
                        shared.idle.notify_all();
                        if shared.closed.load(Ordering::Acquire) {
                            return;
                        }
                        let seen = shared.submitted.load(Ordering::Acquire);
                        // Spin only after a lone request: that is a caller waiting on its answer
                        // before it sends the next. Under load, batches are larger and the
                        // cores are better left to the front-ends.
                        if last_requests <= 1 && role != Role::Reserve {
                            idle_since.get_or_insert_with(Instant::now);
                            let spin = watch_for(lone_streak, shared.batch_time.recent(), recent_gap);
                            if !spin.is_zero() {
                                drop(q);
                                spin_for_next(&shared.submitted, seen, spin);
                                q = shared.lock();
                                // The watch is not the next run's cost.
                                cpu_from = cpu_now();
                            }
                        }
                        let closed = shared.closed.load(Ordering::Acquire);
                        if !closed && shared.submitted.load(Ordering::Acquire) == seen && q.is_empty() {
                            // Idle: sleep until work comes, or until memory a burst grew is due
                            // back (given back outside the lock; the loop then looks again).
                            match instance.give_back_due().map(|at| at.checked_duration_since(Instant::now())) {
                                None => q = shared.wake(role).sleep(q, None),
                                Some(Some(wait)) => q = shared.wake(role).sleep(q, Some(wait)),
                                Some(None) => {
                                    drop(q);
                                    instance.give_back();
                                    q = shared.lock();
                                    cpu_from = cpu_now();
                                }
                            }
                        }
                    }
                }
            }
        };
        let (batch, rows, ticket, quiet, left) = batch;
        last_requests = batch.len();
        lone_streak = if last_requests == 1 { lone_streak.saturating_add(1) } else { 0 };
        let heavy = batch.iter().any(|p| p.heavy);
        shared.running_rows.fetch_add(rows, Ordering::AcqRel);
        let queued = execute(shared, instance.as_mut(), batch, ticket, quiet, cpu_from, left);
        // The other instances' rows: theirs come back too (their answers are not this batch's).
        let elsewhere = shared.running_rows.fetch_sub(rows, Ordering::AcqRel).saturating_sub(rows);
        if let Some(queued) = queued {
            gather.ended(rows, (queued, elsewhere), Instant::now());
        }
        if heavy {
            shared.heavy_running.fetch_sub(1, Ordering::AcqRel);
        }
        if shared.has_solo {
            // Under the lock, so a worker deciding its turn sees this batch finished or is woken.
            let q = shared.lock();
            shared.running.fetch_sub(1, Ordering::AcqRel);
            shared.solo_running.store(false, Ordering::Release);
            let next = shared.next_turn(&q);
            drop(q);
            if let Some(c) = next {
                c.notify_one();
            }
        } else {
            shared.running.fetch_sub(1, Ordering::AcqRel);
        }
        shared.idle.notify_all();
        // Memory a burst grew and no batch has needed since, or that this batch grew beyond
        // what the model's batches usually need: given back before the next batch.
        if instance.give_back_due().is_some_and(|at| at <= Instant::now()) {
            instance.give_back();
        }
    }
}

/// Runs one batch and answers every request in it (after the batches before it, with
/// `preserve_ordering`). Given `left`, the rows left queued when the batch formed and the submits
/// seen then: the rows queued as it ended, before its answers let their callers send again (for
/// `Gather`).
fn execute(
    shared: &Shared,
    instance: &mut dyn Instance,
    batch: Vec<Pending>,
    ticket: u64,
    quiet: Option<u64>,
    cpu_from: Option<Duration>,
    left: Option<(usize, u64)>,
) -> Option<usize> {
    // Held from here, so that a batch that unwinds still passes the turn on (its drop waits for
    // it): a lost turn would stall every later batch of the model.
    let mut turn = shared.spec.batch.preserve_ordering.then_some(AnswerTurn { shared, ticket, held: false });
    let start = Instant::now();
    for p in batch.iter().filter(|p| !p.warmup) {
        shared.stats.queue.add(start - p.enqueued);
        shared.metrics.queue.observe((start - p.enqueued).as_secs_f64());
    }
    // One span per batch that serves a traced request, linked to every request it serves.
    let batch_span = if batch.iter().any(|p| !p.span.is_none()) {
        let span = tracing::debug_span!("batch", model = %shared.spec.name, requests = batch.len());
        for p in &batch {
            span.follows_from(&p.span);
        }
        span
    } else {
        tracing::Span::none()
    };
    let _entered = batch_span.enter();
    let replies = run_isolated(shared, instance, batch, quiet, cpu_from);
    // Requests, not rows, came since: a request of several rows counts one (fewer expected).
    let queued = left.map(|(rows, seen)| rows + (shared.submitted.load(Ordering::Acquire) - seen) as usize);
    if let Some(t) = turn.as_mut() {
        t.wait();
    }
    answer(replies, turn.is_some());
    queued
}

/// Sends a batch's answers. Each answer wakes its caller's task; sent from this thread one by one,
/// each wake of a runtime that has gone idle is a syscall and, on a core shared with the runtime's
/// thread, a preemption: the runtime's thread answers one request, sleeps, and is woken again for
/// the next. Handed to the callers' runtime in one task, the batch costs one wake and the answers
/// wake their tasks on the runtime's own thread (pinned to one core, the MLP at 128 clients went
/// from 0.91 to 0.05 context switches per request: `bench/results/answers.md`). Answers whose
/// callers gave no runtime (`answer_runtime`) are sent here, and so is everything with
/// `in_order` (`preserve_ordering`: while the batch holds its turn).
fn answer(replies: Vec<(Pending, Result<Vec<Tensor>>)>, in_order: bool) {
    let mut runtime = None;
    let mut handed = Answers(Vec::with_capacity(replies.len()));
    let mut direct = Answers(Vec::new());
    for (mut p, r) in replies {
        // Places are given back before the answer, so a client's next request finds them free.
        drop(std::mem::take(&mut p.hold));
        match p.runtime.take().filter(|_| !in_order) {
            Some(rt) => {
                runtime.get_or_insert(rt);
                handed.0.push((p.reply, r));
            }
            None => direct.0.push((p.reply, r)),
        }
    }
    drop(direct);
    match runtime {
        // A task the runtime drops unrun (it is shutting down) still sends them, from its drop.
        Some(rt) if handed.0.len() >= HAND_OVER => drop(rt.spawn(async move { drop(handed) })),
        _ => drop(handed),
    }
}

/// The fewest answers handed to their runtime in one task. Below it the task costs about what it
/// saves: the tiny model, answered in batches of about two, kept its context switches per request
/// and spent 4-14 µs more CPU on each when they were handed over (`bench/results/answers.md`).
const HAND_OVER: usize = 4;

/// The runtime a request submitted now should be answered on (see `answer`): the caller's, when it
/// is a task of a multi-thread runtime, whose workers run on whatever else happens. Never a
/// current-thread runtime (a pipeline's or a Python model's worker), which runs tasks only inside
/// its owner's `block_on`, nor a future polled outside any task (the Python package's calls),
/// which is best woken directly.
pub fn answer_runtime() -> Option<tokio::runtime::Handle> {
    tokio::task::try_id()?;
    let rt = tokio::runtime::Handle::try_current().ok()?;
    (rt.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread).then_some(rt)
}

/// Answers not yet sent; dropping them sends them.
struct Answers(Vec<Reply>);

/// Where one answer goes, and the answer.
type Reply = (tokio::sync::oneshot::Sender<Result<Vec<Tensor>>>, Result<Vec<Tensor>>);

impl Drop for Answers {
    fn drop(&mut self) {
        for (reply, r) in self.0.drain(..) {
            let _ = reply.send(r);
        }
    }
}

/// A batch's turn to answer with `preserve_ordering`: `wait` blocks until every earlier batch has
/// answered; dropping it (after waiting, if it had not) passes the turn to the next.
struct AnswerTurn<'a> {
    shared: &'a Shared,
    ticket: u64,
    held: bool,
}

impl AnswerTurn<'_> {
    fn wait(&mut self) {
        let mut answered = self.shared.answered.lock().unwrap_or_else(|e| e.into_inner());
        while *answered != self.ticket {
            answered = self.shared.answered_turn.wait(answered).unwrap_or_else(|e| e.into_inner());
        }
        self.held = true;
    }
}

impl Drop for AnswerTurn<'_> {
    fn drop(&mut self) {
        if !self.held {
            self.wait();
        }
        *self.shared.answered.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.shared.answered_turn.notify_all();
    }
}

/// Runs `batch`; when the run fails and holds several requests, runs its halves apart (and so on
/// down), so that only the requests that fail get an error, each the error of its own run, and
/// no request's error carries another's data or text. At most 2n - 1 runs for n requests.
fn run_isolated(
    shared: &Shared,
    instance: &mut dyn Instance,
    mut batch: Vec<Pending>,
    quiet: Option<u64>,
    cpu_from: Option<Duration>,
) -> Vec<(Pending, Result<Vec<Tensor>>)> {
    // A request whose client left while it queued, or while an earlier part of its batch ran, is
    // not run (warm-ups have no client to leave).
    if batch.iter().any(|p| !p.warmup && p.reply.is_closed()) {
        let (gone, kept): (Vec<_>, Vec<_>) = batch.into_iter().partition(|p| !p.warmup && p.reply.is_closed());
        shared.cancelled.fetch_add(gone.len() as u64, Ordering::Relaxed);
        let mut replies: Vec<_> =
            gone.into_iter().map(|p| (p, Err(Error::unavailable("the client left", None)))).collect();
        if !kept.is_empty() {
            replies.extend(run_isolated(shared, instance, kept, None, None));
        }
        return replies;
    }
    let result = run(shared, instance, &mut batch, quiet, cpu_from);
    let rows = if shared.each { Vec::new() } else { instance.failed_rows() };
    if !rows.is_empty() {
        return run_without(shared, instance, batch, rows, result.ok());
    }
    match result {
        Ok(outputs) => batch.into_iter().zip(outputs).collect(),
        Err(e) if batch.len() == 1 => {
            // A pipeline stops paying for a request whose client left mid-run: no failure of its.
            if batch[0].reply.is_closed() {
                shared.cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(model = %shared.spec.name, error = %e, "request ended: its client left");
            } else if let Some(left_out) = shared.failures.pass(Instant::now()) {
                tracing::warn!(model = %shared.spec.name, error = %e, left_out, "request failed in the backend");
            }
            batch.into_iter().map(|p| (p, Err(e.clone()))).collect()
        }
        Err(e) => {
            tracing::debug!(model = %shared.spec.name, error = %e, requests = batch.len(), "batch failed; running its halves apart");
            let second = batch.split_off(batch.len() / 2);
            let mut replies = run_isolated(shared, instance, batch, None, None);
            replies.extend(run_isolated(shared, instance, second, None, None));
            replies
        }
    }
}

/// Fails the requests that `rows` (of the run of `batch`) belong to, each with its first row's
/// error (saying which of its rows, when it has several). The rest are answered from `answered`
/// (that run's outputs: it went on without the failed rows) or, when the run failed, run again.
fn run_without(
    shared: &Shared,
    instance: &mut dyn Instance,
    batch: Vec<Pending>,
    mut rows: Vec<(usize, Error)>,
    answered: Option<Vec<Result<Vec<Tensor>>>>,
) -> Vec<(Pending, Result<Vec<Tensor>>)> {
    rows.sort_by_key(|(r, _)| *r);
    let mut answered = answered.map(Vec::into_iter);
    let (mut failed, mut rest, mut offset) = (Vec::new(), Vec::new(), 0);
    for p in batch {
        let (e, out) = (request_error(offset, p.rows, &rows), answered.as_mut().and_then(Iterator::next));
        offset += p.rows;
        match e {
            Some(e) => failed.push((p, Err(e))),
            None => rest.push((p, out)),
        }
    }
    if failed.is_empty() {
        // The rows named belong to no request: trust none of it, and fail the batch as it is.
        let e = Error::internal("a batch named failed rows outside it");
        return rest.into_iter().map(|(p, _)| (p, Err(e.clone()))).collect();
    }
    if answered.is_some() {
        let short = || Err(Error::internal("a batch answered fewer requests than it held"));
        failed.extend(rest.into_iter().map(|(p, out)| (p, out.unwrap_or_else(short))));
    } else if !rest.is_empty() {
        failed.extend(run_isolated(shared, instance, rest.into_iter().map(|(p, _)| p).collect(), None, None));
    }
    failed
}

/// The error of a request whose `count` rows start at batch row `first`, when one of the failed
/// `rows` (sorted by row) is its: its first failed row's, saying which of its rows when it has
/// several.
pub(crate) fn request_error(first: usize, count: usize, rows: &[(usize, Error)]) -> Option<Error> {
    let (r, e) = rows.iter().find(|(r, _)| (first..first + count).contains(r))?;
    Some(match e {
        Error::InvalidInput(m) if count > 1 => Error::InvalidInput(format!("row {}: {m}", r - first)),
        other => other.clone(),
    })
}

/// One run of the backend over `group`, recorded in the statistics, metrics and cost estimates;
/// returns each request's outputs (those it asked for), in order, or (a backend that answers each
/// request apart) its own error. `quiet`: the model's submit count when `group` (a lone request)
/// left its queue empty. `cpu_from`: the thread's CPU clock before `group` was formed, for a
/// backend that `runs_on_caller` (read now when not given).
fn run(
    shared: &Shared,
    instance: &mut dyn Instance,
    group: &mut [Pending],
    quiet: Option<u64>,
    cpu_from: Option<Duration>,
) -> Result<Vec<Result<Vec<Tensor>>>> {
    let start = Instant::now();
    let abandon = watch_clients(group);
    let group = &*group;
    let cpu_start = instance.runs_on_caller().then(|| cpu_from.unwrap_or_else(costs::thread_cpu_time));
    let spec = &shared.spec;
    let rows: usize = group.iter().map(|p| p.rows).sum();
    let inputs = batch_inputs(spec, group, rows)?;
    let elements: usize = inputs.iter().map(|i| i.shape.iter().product::<usize>()).sum();
    crash_context(spec, group, rows, &inputs);
    let usual = shared.costs.lock().unwrap_or_else(|e| e.into_inner()).limit(shared.bounds(), elements / rows.max(1));
    if rows > usual {
        instance.shrink_after_next();
    }
    let awaited = |i: usize| group.get(i).is_none_or(|p| p.warmup || !p.reply.is_closed());
    let mut live = Live::new(group.iter().map(|p| p.rows), &awaited);
    if let Some(seen) = quiet {
        live = live.with_quiet(&shared.submitted, seen);
    }
    if let Some(abandon) = &abandon {
        live = live.with_abandon(abandon);
    }
    if group.iter().any(|p| p.share.is_some()) {
        live = live.with_shares(group.iter().map(|p| p.share.clone()).collect());
    }
    if shared.each {
        live = live.with_ids(
            group
                .iter()
                .map(|p| (p.id.as_deref().unwrap_or_default(), p.parameters.as_deref().unwrap_or("{}")))
                .collect(),
        );
    }
    let result = catch_unwind(AssertUnwindSafe(|| {
        if shared.each {
            instance.run_each(&inputs, &live).map(Answer::Each)
        } else {
            instance.run_live(&inputs, &live).map(Answer::Batch)
        }
    }))
    .unwrap_or_else(|_| {
        // The batch fails (and is run apart); the instance and the server go on.
        tracing::error!(model = %spec.name, requests = group.len(), "the backend panicked while running a batch");
        shared.metrics.panics.inc();
        Err(Error::internal("the backend panicked while running the request"))
    });
    crate::crash::idle();
    drop(inputs);
    let done = Instant::now();
    let outputs = result.and_then(|answer| match answer {
        Answer::Batch(o) => check_outputs(o, spec.batched(), rows)
            .and_then(|o| split(spec, group, o))
            .map(|each| each.into_iter().map(Ok).collect()),
        Answer::Each(each) => {
            if each.len() != group.len() {
                return Err(Error::internal(format!("{} answers for {} requests", each.len(), group.len())));
            }
            Ok(each.into_iter().zip(group).map(|(r, p)| r.and_then(|o| own_outputs(spec, p, o))).collect())
        }
    });
    // Warm-ups are not traffic: they neither count nor seed the estimates.
    if !group.iter().all(|p| p.warmup) {
        shared.batch_time.record(done - start);
        if outputs.is_ok() {
            // What the run cost, not how long it waited for its core: on a core shared with
            // the I/O threads, the batch after a large one was stretched by writing that one's
            // answers, and sizes that had served well once measured twice as dear.
            let cost = cpu_start.map_or(done - start, |c| costs::thread_cpu_time().saturating_sub(c));
            shared.costs.lock().unwrap_or_else(|e| e.into_inner()).record(rows, elements, cost);
        }
        // Statistics before the answers, so a client that reads them after its answer sees its
        // own batch. Input: the copy into the engine's buffers; inference: the rest of the run;
        // output: splitting the outputs per request.
        let input = instance.input_time().min(done - start);
        shared.stats.record_batch(rows, group.len(), input, done - start - input, done.elapsed());
        let m = &shared.metrics;
        m.executions.inc();
        m.inferences.inc_by(rows as u64);
        m.batch_size.observe(rows as f64);
        m.compute.observe(start.elapsed().as_secs_f64());
    }
    outputs
}

/// Counts `group`'s clients as they leave, from the threads that drop their receivers, so that a
/// run none of them awaits any more can be stopped (`Live::on_abandoned`). None for a group with
/// a warm-up, which has no client to leave.
fn watch_clients(group: &mut [Pending]) -> Option<Arc<Abandon>> {
    if group.iter().any(|p| p.warmup) {
        return None;
    }
    let abandon = Arc::new(Abandon::new(group.len()));
    let waker = Waker::from(abandon.clone());
    let mut cx = Context::from_waker(&waker);
    for p in group {
        if p.reply.poll_closed(&mut cx).is_ready() {
            abandon.left();
        }
    }
    Some(abandon)
}

/// What a run gave back: outputs for the whole batch, or each request's own.
enum Answer {
    Batch(Vec<Tensor>),
    Each(Vec<Result<Vec<Tensor>>>),
}

/// A request's own answer (from a backend that answers each apart) as the request asked for it:
/// outputs of the model's, of its datatypes, those it asked for in its order (all, in the model's
/// order, when it named none).
fn own_outputs(spec: &ModelSpec, p: &Pending, mut outputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
    for t in &outputs {
        match spec.outputs.iter().find(|s| s.name == t.name) {
            None => {
                return Err(Error::internal(format!(
                    "the model answered output '{}', which its config does not have",
                    t.name
                )))
            }
            Some(s) if s.datatype != t.datatype => {
                return Err(Error::internal(format!(
                    "the model answered output '{}' as {}, its config says {}",
                    t.name, t.datatype, s.datatype
                )))
            }
            Some(_) => {}
        }
    }
    match &p.outputs {
        None => {
            outputs.sort_by_key(|t| spec.outputs.iter().position(|s| s.name == t.name));
            Ok(outputs)
        }
        Some(asked) => asked
            .iter()
            .map(|&i| {
                let name = &spec.outputs[i].name;
                let at = outputs.iter().position(|t| &t.name == name).ok_or_else(|| {
                    Error::internal(format!("the model's response has no output '{name}', which the request asked for"))
                })?;
                Ok(outputs.swap_remove(at))
            })
            .collect(),
    }
}

/// The group's inputs as the backend takes them: the requests of a group give the same inputs
/// (optional ones may be left out) with the same non-batch dims, joined along dim 0 (`rows` in
/// all) and reshaped to the model's shape where the config says so.
fn batch_inputs<'a>(spec: &ModelSpec, group: &'a [Pending], rows: usize) -> Result<Vec<BatchInput<'a>>> {
    let batched = spec.batched();
    group[0]
        .inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut shape = t.shape.clone();
            if batched {
                shape[0] = rows;
            }
            if let Some(to) = spec.reshape.get(&t.name) {
                shape = reshaped(&shape, batched, to)?;
            }
            Ok(BatchInput {
                name: &t.name,
                datatype: t.datatype,
                shape,
                parts: group.iter().map(|p| &p.inputs[i].data).collect(),
            })
        })
        .collect()
}

/// What a crash report says of this run, should the backend take the process down (never the data).
fn crash_context(spec: &ModelSpec, group: &[Pending], rows: usize, inputs: &[BatchInput<'_>]) {
    crate::crash::running(|w| {
        let thread = std::thread::current();
        let _ = writeln!(
            w,
            "model '{}' version {} on worker thread {}",
            spec.name,
            spec.version,
            thread.name().unwrap_or("?")
        );
        let _ = writeln!(w, "batch of {rows} row(s) from {} request(s)", group.len());
        for i in inputs {
            let _ = writeln!(w, "input '{}' {} {:?}", i.name, i.datatype, i.shape);
        }
    });
}

/// The batch's outputs, given back the clients' shapes, as each request's rows of the outputs it
/// asked for (without copying fixed-size data).
fn split(spec: &ModelSpec, group: &[Pending], mut outputs: Vec<Tensor>) -> Result<Vec<Vec<Tensor>>> {
    let batched = spec.batched();
    for t in outputs.iter_mut() {
        if let Some(dims) = spec.outputs.iter().find(|s| s.name == t.name && spec.reshape.contains_key(&s.name)) {
            t.shape = reshaped(&t.shape, batched, &dims.dims)?;
        }
    }
    let mut offset = 0;
    Ok(group
        .iter()
        .map(|p| {
            let take = |o: &Tensor| if batched { o.rows(offset, p.rows) } else { o.clone() };
            let mine = match &p.outputs {
                None => outputs.iter().map(take).collect(),
                Some(idx) => idx.iter().map(|&i| take(&outputs[i])).collect(),
            };
            offset += p.rows;
            mine
        })
        .collect())
}

fn check_outputs(outputs: Vec<Tensor>, batched: bool, rows: usize) -> Result<Vec<Tensor>> {
    if batched {
        if let Some(o) = outputs.iter().find(|o| o.shape.first() != Some(&rows)) {
            return Err(Error::internal(format!(
                "output '{}' has shape {:?}, expected dim 0 = batch size {rows}",
                o.name, o.shape
            )));
        }
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{engine::spec::QueuePolicy, DataType};
    use tokio::sync::oneshot;

    #[test]
    fn idle_spin_follows_a_lone_clients_gaps_within_bounds() {
        let us = Duration::from_micros;
        assert_eq!(idle_spin(us(10)), IDLE_SPIN, "never shorter than the fixed watch");
        assert_eq!(idle_spin(us(120)), us(240));
        assert_eq!(idle_spin(us(300)), IDLE_SPIN_MAX, "never longer than the cap");
        assert_eq!(idle_spin(IDLE_SPIN_MAX), IDLE_SPIN_MAX);
        assert_eq!(idle_spin(IDLE_SPIN_MAX + us(1)), IDLE_SPIN, "gaps no watching would catch");
        assert_eq!(idle_spin(Duration::from_secs(2)), IDLE_SPIN);
    }

    #[test]
    fn a_batch_takes_an_equal_share_of_the_work_about() {
        assert_eq!(share(64, 29, 2, 2), 16, "29 queued beside 2 running: half of the 31");
        assert_eq!(share(64, 30, 0, 4), 8, "four idle workers");
        assert_eq!(share(8, 30, 0, 2), 8, "never past the limit");
        assert_eq!(share(64, 3, 60, 2), 32, "the rows running elsewhere count: all 3 queued may go");
        assert_eq!(share(64, 1, 0, 2), 1, "a lone row still runs");
        assert_eq!(share(64, 128, 0, 1), 64, "one instance takes what its limit allows");
    }

    #[test]
    fn only_a_quick_model_watches_and_longer_only_for_its_lone_client() {
        let (us, ms) = (Duration::from_micros, Duration::from_millis);
        assert_eq!(watch_for(LONE_STREAK, us(300), us(150)), us(300), "a lone client of a quick model");
        assert_eq!(watch_for(LONE_STREAK - 1, us(300), us(150)), IDLE_SPIN, "a lone batch now and then");
        assert_eq!(watch_for(u32::MAX, WATCH_BELOW, us(150)), us(300));
        assert_eq!(watch_for(LONE_STREAK, us(300), ms(3)), IDLE_SPIN, "a client that pauses");
        // A slower model's worker does not watch: the answer's delivery needs the core.
        for (streak, gap) in [(LONE_STREAK, us(150)), (0, us(150)), (LONE_STREAK, ms(3))] {
            assert_eq!(watch_for(streak, ms(5), gap), Duration::ZERO, "a conv net");
            assert_eq!(watch_for(streak, WATCH_BELOW + us(1), gap), Duration::ZERO, "a text encoder");
        }
    }

    /// A one-row request answered on `runtime`, and where its answer arrives.
    fn pending(runtime: Option<tokio::runtime::Handle>) -> (Pending, oneshot::Receiver<Result<Vec<Tensor>>>) {
        let (tx, rx) = oneshot::channel();
        (Pending { runtime, ..Pending::new(Vec::new(), 1, tx) }, rx)
    }

    fn answered(i: usize) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::from_le("y", DataType::Int64, vec![1], &[i as i64])])
    }

    fn value(answer: Result<Vec<Tensor>>) -> i64 {
        let t = answer.unwrap();
        i64::from_le_bytes(t[0].data.to_wire()[..8].try_into().unwrap())
    }

    fn multi_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap()
    }

    #[test]
    fn a_run_is_abandoned_once_every_client_has_left_and_not_before() {
        use std::sync::atomic::AtomicUsize;
        let (mut group, mut receivers): (Vec<_>, Vec<_>) = (0..3).map(|_| pending(None)).unzip();
        drop(receivers.pop()); // gone before the run
        let abandon = watch_clients(&mut group).unwrap();
        let live = Live::new([1, 1, 1], &|_| true).with_abandon(&abandon);
        let stops = Arc::new(AtomicUsize::new(0));
        let count = |stops: &Arc<AtomicUsize>| {
            let stops = stops.clone();
            move || {
                stops.fetch_add(1, Ordering::SeqCst);
            }
        };
        live.on_abandoned(count(&stops));
        drop(receivers.pop());
        assert_eq!(stops.load(Ordering::SeqCst), 0, "one client still waits");
        // The last leaves on another thread, as an I/O thread drops its receiver.
        let last = receivers.pop().unwrap();
        std::thread::spawn(move || drop(last)).join().unwrap();
        assert_eq!(stops.load(Ordering::SeqCst), 1);
        // A stop asked for once all have left comes at once.
        live.on_abandoned(count(&stops));
        assert_eq!(stops.load(Ordering::SeqCst), 2);

        // Answered, then gone: not a client leaving its run.
        let (p, rx) = pending(None);
        let mut group = vec![p];
        let abandon = watch_clients(&mut group).unwrap();
        Live::new([1], &|_| true).with_abandon(&abandon).on_abandoned(count(&stops));
        let _ = group.pop().unwrap().reply.send(answered(0));
        drop(rx);
        assert_eq!(stops.load(Ordering::SeqCst), 2);
        // A warm-up has no client: its batch is never abandoned.
        let (mut warm, _rx) = pending(None);
        warm.warmup = true;
        assert!(watch_clients(&mut [warm]).is_none());
    }

    #[test]
    fn a_batch_is_held_for_the_last_ones_callers_then_not_after_a_hold_that_gained_nothing() {
        // Batches of 1 to 8 rows (of one element each) cost alike.
        let costs = Mutex::new(BatchCosts::default());
        for rows in [1, 2, 4, 8] {
            for _ in 0..4 {
                costs.lock().unwrap().record(rows, rows, Duration::from_micros(900));
            }
        }
        let mut q = Queue::new(&[QueuePolicy { max_queue_size: 16, ..QueuePolicy::default() }]);
        let mut waiting = Vec::new();
        for _ in 0..4 {
            let (mut p, rx) = pending(None);
            p.inputs = vec![Tensor::from_le("x", DataType::Fp32, vec![1, 1], &[0f32])];
            q.push(p).unwrap();
            waiting.push(rx);
        }
        let t = Instant::now();
        let mut g = Gather::default();
        // Nothing ran yet: nothing is expected.
        assert_eq!(g.hold(&costs, &q, 64, t), None);
        // A batch of 4 ended with 4 queued: its 4 callers are expected back, for up to a run of 4.
        g.ended(4, (4, 0), t);
        let until = t + Duration::from_micros(900);
        assert_eq!(g.hold(&costs, &q, 64, t), Some((8, until)));
        // Decided once: looking again later keeps the same end.
        assert_eq!(g.hold(&costs, &q, 64, t + Duration::from_micros(500)), Some((8, until)));
        // More rows about than one batch takes (many clients): batches fill without waiting.
        assert_eq!(g.hold(&costs, &q, 6, t), None);
        let mut crowded = Gather::default();
        crowded.ended(4, (4, 60), t);
        assert_eq!(crowded.hold(&costs, &q, 64, t), None);
        // Its end passed with no row more: the next batches form at once.
        g.formed(4, until);
        g.ended(4, (4, 0), until);
        for _ in 0..HOLD_BACKOFF {
            assert_eq!(g.hold(&costs, &q, 64, until), None);
            g.formed(4, until);
        }
        assert!(g.hold(&costs, &q, 64, until).is_some());
        // A batch forming long after the last ended is not held for its callers.
        g.formed(8, until);
        let late = until + RETURN_WITHIN + Duration::from_millis(1);
        assert_eq!(g.hold(&costs, &q, 64, late), None);
    }

    #[test]
    fn only_tasks_of_a_multi_thread_runtime_are_answered_on_it() {
        assert!(answer_runtime().is_none(), "no runtime");
        let rt = multi_thread();
        assert!(
            rt.block_on(rt.spawn(async { answer_runtime() })).unwrap().is_some(),
            "a task of a multi-thread runtime"
        );
        // A future polled by `block_on` (as the Python package polls its calls) is no task.
        assert!(rt.block_on(async { answer_runtime() }).is_none(), "block_on's own future");
        let _entered = rt.enter();
        assert!(answer_runtime().is_none(), "a thread that only entered the runtime");
        let local = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert!(local.block_on(local.spawn(async { answer_runtime() })).unwrap().is_none(), "a current-thread runtime");
    }

    #[test]
    fn every_answer_of_a_batch_reaches_its_caller_whatever_runtime_it_gave() {
        let rt = multi_thread();
        let handle = rt.block_on(rt.spawn(async { answer_runtime() })).unwrap();
        let local = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        for in_order in [false, true] {
            let mut replies = Vec::new();
            let mut waiting = Vec::new();
            for i in 0..3 * HAND_OVER {
                // Two callers on the multi-thread runtime's tasks, one beside them with none.
                let (p, rx) = pending(if i % 3 == 2 { None } else { handle.clone() });
                replies.push((p, answered(i)));
                waiting.push(rx);
            }
            answer(replies, in_order);
            // Awaited from a runtime that is not the one answering: nothing here drives those tasks.
            let got: Vec<i64> = local.block_on(async {
                let mut got = Vec::new();
                for rx in waiting {
                    got.push(value(tokio::time::timeout(Duration::from_secs(10), rx).await.unwrap().unwrap()));
                }
                got
            });
            assert_eq!(got, (0..3 * HAND_OVER as i64).collect::<Vec<_>>(), "in order: {in_order}");
        }
    }

    #[test]
    fn answers_for_a_runtime_that_shut_down_still_arrive() {
        let rt = multi_thread();
        let handle = rt.block_on(rt.spawn(async { answer_runtime() })).unwrap();
        rt.shutdown_timeout(Duration::from_secs(5));
        let (replies, waiting): (Vec<_>, Vec<_>) = (0..HAND_OVER)
            .map(|i| {
                let (p, rx) = pending(handle.clone());
                ((p, answered(i)), rx)
            })
            .unzip();
        answer(replies, false);
        for (i, mut rx) in waiting.into_iter().enumerate() {
            assert_eq!(value(rx.try_recv().expect("answered when the task was dropped unrun")), i as i64);
        }
    }
}
