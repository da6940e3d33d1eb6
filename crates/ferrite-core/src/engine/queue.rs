//! The per-model request queue and the rule that turns it into batches.
//!
//! Pure logic: the caller passes `now`, so every decision is testable without sleeping.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use crate::{
    engine::spec::{BatchPolicy, QueuePolicy, TimeoutAction},
    wire::RETRY_AFTER,
    Error, Result, Tensor,
};

/// What a request holds while its work is queued or running (its tenant's concurrency place, its
/// place under the process's cap): released when the batcher is done with it, not when its client
/// leaves, so a client that disconnects cannot free its place while its work still runs.
#[derive(Default)]
pub struct Hold(pub Vec<Box<dyn std::any::Any + Send + Sync>>);

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Hold({})", self.0.len())
    }
}

/// One admitted request waiting for an instance.
#[derive(Debug)]
pub struct Pending {
    /// The client's request id and parameters (a JSON object), for a backend that shows them
    /// to its code (a Python model's `request_id()` and `parameters()`).
    pub id: Option<String>,
    pub parameters: Option<String>,
    /// In model input order, validated.
    pub inputs: Vec<Tensor>,
    /// Dim-0 size when the model batches, else 1.
    pub rows: usize,
    /// Indices of the outputs to return; `None` for all.
    pub outputs: Option<Vec<usize>>,
    /// 0 is the highest priority.
    pub level: usize,
    pub enqueued: Instant,
    pub deadline: Option<Instant>,
    pub reply: oneshot::Sender<Result<Vec<Tensor>>>,
    /// The async runtime whose task awaits `reply`, if any: a batch's answers are handed to it in
    /// one task rather than each waking it from the batcher's thread (see `batcher::answer`).
    pub runtime: Option<tokio::runtime::Handle>,
    /// The request's span, which the batch span that serves it links to.
    pub span: tracing::Span,
    /// A load's warm-up request: run at once, and left out of the statistics.
    pub warmup: bool,
    pub hold: Hold,
    /// Costly beyond the model's light work (a pipeline request of many megapixels or much
    /// text): such requests never keep light ones waiting for an instance (the batcher's reserve,
    /// or its last instance, takes those), and never share a batch with them.
    pub heavy: bool,
    /// The share of the server its turn counts in (`InferRequest::share`): requests of several
    /// shares take turns in a level, by rows, and one share's hold at most half of a level's
    /// places. `None`: no share (requests of none, waiting alone, go first come, first served).
    pub share: Option<Arc<str>>,
}

impl Pending {
    /// A request of `inputs` (`rows` rows) queued now at the first priority level, with nothing
    /// else set; a caller sets what it needs besides with struct update (`..Pending::new(..)`).
    pub fn new(inputs: Vec<Tensor>, rows: usize, reply: oneshot::Sender<Result<Vec<Tensor>>>) -> Pending {
        Pending {
            id: None,
            parameters: None,
            inputs,
            rows,
            outputs: None,
            level: 0,
            enqueued: Instant::now(),
            deadline: None,
            reply,
            runtime: None,
            span: tracing::Span::none(),
            warmup: false,
            hold: Hold::default(),
            heavy: false,
            share: None,
        }
    }

    /// Input elements per row (the whole request's when it has one row): what tells a batch of
    /// small images from one of large ones.
    pub fn row_elements(&self) -> usize {
        self.inputs.iter().map(|t| t.shape.iter().product::<usize>()).sum::<usize>() / self.rows.max(1)
    }

    /// Whether `other` may share a batch with `self`: every non-batch dim equal.
    fn compatible(&self, other: &Pending) -> bool {
        // The same inputs (optional ones may be left out) with the same non-batch dims.
        self.heavy == other.heavy
            && self.inputs.len() == other.inputs.len()
            && self
                .inputs
                .iter()
                .zip(&other.inputs)
                .all(|(a, b)| a.shape.get(1..) == b.shape.get(1..) && a.name == b.name)
    }
}

#[derive(Debug)]
pub enum Decision {
    /// Run these now, in this order.
    Run(Vec<Pending>),
    /// Nothing to run before this instant (unless a request arrives).
    WaitUntil(Instant),
    /// Nothing queued.
    Idle,
}

/// One priority level: requests in time, one lane per share waiting (those of no share are one
/// more), then (`timeout_action = delay`) those past their timeout, in arrival order.
///
/// Requests take turns by rows across the lanes: the next is the one whose share will have been
/// run the fewest rows once it has run, counting its share's requests queued ahead of it and its
/// own rows (then the earliest), so each share's requests take turns with the others' whatever
/// one share queued before, and a short request goes ahead of a long one that came level (fair
/// queueing's finish tags; by the rows run before it, the tie went to the older and a short
/// request waited a whole long one). A share that comes starts at the key of the last turn taken
/// (fair queueing's virtual time): no credit from before it waited, and a share whose short
/// requests come and go cannot keep taking turns ahead of one waiting with a long request.
/// While one lane waits, that is first come, first served. Forming a batch reads the lanes'
/// heads and the requests it takes, never the whole queue (a heap over the lanes' next turns),
/// and the counts admission needs are kept as requests come and go (as Triton's scheduler keeps
/// its own).
#[derive(Debug)]
struct Level {
    lanes: HashMap<Option<Arc<str>>, Lane>,
    delayed: VecDeque<Pending>,
    policy: QueuePolicy,
    /// The arrival number of the next request (ties between turns go to the earlier).
    arrivals: u64,
    /// The key of the last turn taken from a lane: where a share that comes starts (see above;
    /// never less than a waiting lane's rows run, which count only turns taken).
    clock: u64,
    len: usize,
    rows: usize,
    /// At or before the earliest deadline of a request in a lane (none: no deadline there).
    due: Option<Instant>,
    /// Requests waiting per share, in lanes or delayed (against the half a share may hold).
    shares: HashMap<Arc<str>, usize>,
}

/// One share's requests in time at a level, in arrival order, with their arrival numbers.
#[derive(Debug)]
struct Lane {
    queue: VecDeque<(u64, Pending)>,
    rows: usize,
    /// The rows of this share run while it waited, from where it started (see `Level`).
    served: u64,
}

impl Lane {
    /// The position of the first request at or after `from` that `keep` passes.
    fn kept_from(&self, from: usize, keep: &impl Fn(&Pending) -> bool) -> Option<usize> {
        (from..self.queue.len()).find(|&i| keep(&self.queue[i].1))
    }

    /// The rows of this lane whose turns come at or before `key` (ties: these came first).
    fn rows_until(&self, key: u64) -> usize {
        if self.served + self.rows as u64 <= key {
            return self.rows;
        }
        let (mut done, mut rows) = (self.served, 0);
        for (_, p) in &self.queue {
            done += p.rows as u64;
            if done > key {
                break;
            }
            rows += p.rows;
        }
        rows
    }
}

/// Where a queued request is in its level (`Level::take`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Place {
    Lane(Option<Arc<str>>, usize),
    Delayed(usize),
}

impl Place {
    /// The lane's share, or `None` for the delayed requests.
    fn lane(&self) -> Option<&Option<Arc<str>>> {
        match self {
            Place::Lane(share, _) => Some(share),
            Place::Delayed(_) => None,
        }
    }
}

/// The same, read in place (`Level::turns`).
#[derive(Clone, Copy)]
enum Spot<'a> {
    Lane(&'a Option<Arc<str>>, usize),
    Delayed(usize),
}

impl Spot<'_> {
    fn place(self) -> Place {
        match self {
            Spot::Lane(share, i) => Place::Lane(share.clone(), i),
            Spot::Delayed(i) => Place::Delayed(i),
        }
    }
}

/// A lane's next turn in a `Turns` heap: its key (the lane's rows run once that request has run)
/// and arrival (unique in a level) order it.
struct Turn<'a> {
    key: u64,
    arrival: u64,
    share: &'a Option<Arc<str>>,
    lane: &'a Lane,
    at: usize,
}

impl PartialEq for Turn<'_> {
    fn eq(&self, other: &Self) -> bool {
        (self.key, self.arrival) == (other.key, other.arrival)
    }
}

impl Eq for Turn<'_> {}

impl PartialOrd for Turn<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Turn<'_> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.key, self.arrival).cmp(&(other.key, other.arrival))
    }
}

/// A level's requests that `keep` passes, in the order of their turns (see `Level`), read in
/// place: each step pops the least lane's next turn and pushes that lane's following one.
struct Turns<'a, K> {
    next: BinaryHeap<Reverse<Turn<'a>>>,
    delayed: std::iter::Enumerate<std::collections::vec_deque::Iter<'a, Pending>>,
    keep: K,
}

impl<'a, K: Fn(&Pending) -> bool> Iterator for Turns<'a, K> {
    type Item = (Spot<'a>, &'a Pending);

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(Reverse(turn)) = self.next.pop() {
            let p = &turn.lane.queue[turn.at].1;
            if let Some(at) = turn.lane.kept_from(turn.at + 1, &self.keep) {
                let arrival = turn.lane.queue[at].0;
                self.next.push(Reverse(Turn {
                    key: turn.key + turn.lane.queue[at].1.rows as u64,
                    arrival,
                    at,
                    ..turn
                }));
            }
            return Some((Spot::Lane(turn.share, turn.at), p));
        }
        let keep = &self.keep;
        self.delayed.find(|(_, p)| keep(p)).map(|(i, p)| (Spot::Delayed(i), p))
    }
}

impl Level {
    fn new(policy: QueuePolicy) -> Level {
        Level {
            lanes: HashMap::new(),
            delayed: VecDeque::new(),
            policy,
            arrivals: 0,
            clock: 0,
            len: 0,
            rows: 0,
            due: None,
            shares: HashMap::new(),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &Pending> {
        self.lanes.values().flat_map(|l| l.queue.iter().map(|(_, p)| p)).chain(&self.delayed)
    }

    /// The places of this level `share`'s requests hold already, against the half they may.
    fn held_by(&self, share: &Option<Arc<str>>) -> Option<usize> {
        share.as_ref().map(|s| self.shares.get(s).copied().unwrap_or(0))
    }

    fn enter(&mut self, p: &Pending) {
        self.len += 1;
        self.rows += p.rows;
        if let Some(s) = &p.share {
            *self.shares.entry(s.clone()).or_default() += 1;
        }
    }

    /// After `p` was removed from its lane or the delayed ones.
    fn leave(&mut self, p: &Pending) {
        self.len -= 1;
        self.rows -= p.rows;
        if let Some(s) = &p.share {
            if let Some(n) = self.shares.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    self.shares.remove(s);
                }
            }
        }
    }

    fn push_back(&mut self, p: Pending) {
        self.enter(&p);
        if let Some(d) = p.deadline {
            self.due = Some(self.due.map_or(d, |due| due.min(d)));
        }
        let arrival = self.arrivals;
        self.arrivals += 1;
        let lane = match self.lanes.get_mut(&p.share) {
            Some(lane) => lane,
            None => {
                let lane = Lane { queue: VecDeque::new(), rows: 0, served: self.clock };
                self.lanes.entry(p.share.clone()).or_insert(lane)
            }
        };
        lane.rows += p.rows;
        lane.queue.push_back((arrival, p));
    }

    /// The requests `keep` passes, in the order of their turns; those past their timeout last.
    fn turns<K: Fn(&Pending) -> bool>(&self, keep: K) -> Turns<'_, K> {
        let next = self.heads(&keep).map(Reverse).collect();
        Turns { next, delayed: self.delayed.iter().enumerate(), keep }
    }

    /// The first request of `turns(keep)`, found without a heap.
    fn first(&self, keep: impl Fn(&Pending) -> bool) -> Option<&Pending> {
        let head = self.heads(&keep).min().map(|turn| &turn.lane.queue[turn.at].1);
        head.or_else(|| self.delayed.iter().find(|p| keep(p)))
    }

    /// Each lane's first turn of a request `keep` passes.
    fn heads<'a, 'k, K: Fn(&Pending) -> bool>(
        &'a self,
        keep: &'k K,
    ) -> impl Iterator<Item = Turn<'a>> + use<'a, 'k, K> {
        self.lanes.iter().filter_map(|(share, lane)| {
            let at = lane.kept_from(0, keep)?;
            Some(Turn { key: lane.served + lane.queue[at].1.rows as u64, arrival: lane.queue[at].0, share, lane, at })
        })
    }

    /// The earliest deadline of a request in a lane.
    fn earliest_deadline(&self) -> Option<Instant> {
        self.lanes.values().flat_map(|l| &l.queue).filter_map(|(_, p)| p.deadline).min()
    }

    /// The rows that run before a request of `share` and `rows` rows that comes now: those in
    /// lanes whose turns come first (every row of its own share's lane among them); not the
    /// delayed ones.
    fn rows_before(&self, share: &Option<Arc<str>>, rows: usize) -> usize {
        let own = self.lanes.get(share).map_or(self.clock, |l| l.served + l.rows as u64) + rows as u64;
        self.lanes.values().map(|lane| lane.rows_until(own)).sum()
    }

    /// Takes the requests at `positions` (ascending, each once) of `share`'s lane (`None`: of the
    /// delayed ones), in that order; rows taken from a lane count as its share's turns.
    fn take(
        &mut self,
        share: Option<&Option<Arc<str>>>,
        positions: impl DoubleEndedIterator<Item = usize> + ExactSizeIterator,
    ) -> Vec<Pending> {
        let taken: Vec<Pending> = match share {
            Some(share) => {
                let lane = self.lanes.get_mut(share).expect("a lane of this level");
                let taken = remove_at(&mut lane.queue, positions, |(_, p)| p);
                let rows: usize = taken.iter().map(|p| p.rows).sum();
                lane.rows -= rows;
                lane.served += rows as u64;
                self.clock = self.clock.max(lane.served);
                if lane.queue.is_empty() {
                    // A share that waits no more starts at the clock when it comes back.
                    self.lanes.remove(share);
                }
                taken
            }
            None => remove_at(&mut self.delayed, positions, |p| p),
        };
        for p in &taken {
            self.leave(p);
        }
        taken
    }

    /// Drops requests whose client left from the front of each lane and of the delayed ones;
    /// returns how many.
    fn drop_closed_fronts(&mut self) -> usize {
        let mut dropped = Vec::new();
        for lane in self.lanes.values_mut() {
            while lane.queue.front().is_some_and(|(_, p)| p.reply.is_closed()) {
                let (_, p) = lane.queue.pop_front().expect("a front");
                lane.rows -= p.rows;
                dropped.push(p);
            }
        }
        if !dropped.is_empty() {
            self.lanes.retain(|_, lane| !lane.queue.is_empty());
        }
        while self.delayed.front().is_some_and(|p| p.reply.is_closed()) {
            dropped.extend(self.delayed.pop_front());
        }
        for p in &dropped {
            self.leave(p);
        }
        dropped.len()
    }

    /// Counts rows and shares again (after requests were removed in place).
    fn recount(&mut self) {
        self.lanes.retain(|_, lane| !lane.queue.is_empty());
        for lane in self.lanes.values_mut() {
            lane.rows = lane.queue.iter().map(|(_, p)| p.rows).sum();
        }
        let (mut len, mut rows, mut shares) = (0, 0, HashMap::new());
        for p in self.iter() {
            len += 1;
            rows += p.rows;
            if let Some(s) = &p.share {
                *shares.entry(s.clone()).or_default() += 1;
            }
        }
        (self.len, self.rows, self.shares) = (len, rows, shares);
        self.due = self.earliest_deadline();
    }
}

/// Removes the items at `positions` (ascending, each once) from `deque`, in that order, each as
/// `f` makes it: a run from the front (the usual batch) is drained at once.
fn remove_at<T, U>(
    deque: &mut VecDeque<T>,
    positions: impl DoubleEndedIterator<Item = usize> + ExactSizeIterator,
    f: impl FnMut(T) -> U,
) -> Vec<U> {
    let n = positions.len();
    let mut positions = positions.rev().peekable();
    if positions.peek().is_some_and(|&last| last + 1 == n) {
        return deque.drain(..n).map(f).collect();
    }
    let mut taken: Vec<T> = positions.map(|i| deque.remove(i).expect("a position of the deque")).collect();
    taken.reverse();
    taken.into_iter().map(f).collect()
}

#[derive(Debug)]
pub struct Queue {
    levels: Vec<Level>,
    len: usize,
    /// Requests whose clients left before they ran.
    pub cancelled: u64,
    /// Requests that timed out while queued and were rejected.
    pub expired: u64,
    /// Requests that timed out while queued and were moved behind the others (`delay`).
    pub delayed: u64,
}

impl Queue {
    /// One level per policy, highest priority first.
    pub fn new(policies: &[QueuePolicy]) -> Queue {
        let mut levels: Vec<Level> = policies.iter().cloned().map(Level::new).collect();
        if levels.is_empty() {
            levels.push(Level::new(QueuePolicy::default()));
        }
        Queue { levels, len: 0, cancelled: 0, expired: 0, delayed: 0 }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows waiting at every level.
    /// The request the next batch starts with (light ones only, with `light_only`).
    pub fn head(&self, light_only: bool) -> Option<&Pending> {
        self.levels.iter().find_map(|l| l.first(|p| !(light_only && p.heavy)))
    }

    pub fn rows(&self) -> usize {
        self.levels.iter().map(|l| l.rows).sum()
    }

    /// The rows a new request of `share` and `rows` rows at `level` queues behind: those waiting
    /// at the levels above, and those at its own whose turns come first (all of them while its
    /// share, or none other, waits there alone).
    pub fn rows_ahead(&self, level: usize, share: &Option<Arc<str>>, rows: usize) -> usize {
        let index = level.min(self.levels.len() - 1);
        self.levels.iter().take(index).map(|l| l.rows).sum::<usize>() + self.levels[index].rows_before(share, rows)
    }

    /// Requests waiting at `level` and above.
    pub fn requests_ahead(&self, level: usize) -> usize {
        self.levels.iter().take(level + 1).map(|l| l.len).sum()
    }

    /// Admits `p`, or refuses it when its level's queue is full, or holds half of it for `p`'s
    /// share already (a share's requests hold at most half of a level's places, at least one, so
    /// one tenant's flood leaves another's requests places to queue in).
    pub fn push(&mut self, p: Pending) -> Result<()> {
        let last = self.levels.len() - 1;
        let index = p.level.min(last);
        let half = |level: &Level| (level.policy.max_queue_size / 2).max(1);
        let full = |level: &Level| {
            level.len >= level.policy.max_queue_size || level.held_by(&p.share).is_some_and(|n| n >= half(level))
        };
        if full(&self.levels[index]) {
            // Requests whose clients left, or that expired, free their places before a refusal.
            self.prune(p.enqueued);
        }
        let level = &mut self.levels[index];
        if level.len >= level.policy.max_queue_size {
            return Err(Error::unavailable(
                format!("queue full: {} requests waiting at this priority (max_queue_size)", level.len),
                Some(RETRY_AFTER),
            ));
        }
        if let Some(n) = level.held_by(&p.share).filter(|&n| n >= half(level)) {
            return Err(Error::unavailable(
                format!(
                    "queue full for this tenant: its {n} requests waiting at this priority hold half of the \
                     queue (max_queue_size {})",
                    level.policy.max_queue_size
                ),
                Some(RETRY_AFTER),
            ));
        }
        level.push_back(p);
        self.len += 1;
        Ok(())
    }

    /// Removes every queued request (for shutdown), highest priority first, each level's in
    /// arrival order.
    pub fn drain(&mut self) -> Vec<Pending> {
        self.len = 0;
        let mut out = Vec::new();
        for l in &mut self.levels {
            let mut fresh: Vec<(u64, Pending)> = l.lanes.drain().flat_map(|(_, lane)| lane.queue).collect();
            fresh.sort_unstable_by_key(|(arrival, _)| *arrival);
            out.extend(fresh.into_iter().map(|(_, p)| p).chain(l.delayed.drain(..)));
            (l.len, l.rows, l.due) = (0, 0, None);
            l.shares.clear();
        }
        out
    }

    /// Drops requests whose client left, and rejects or delays those whose timeout passed.
    pub fn prune(&mut self, now: Instant) {
        for i in 0..self.levels.len() {
            self.prune_level(i, now);
        }
    }

    /// What forming a batch needs of `prune`, without reading every request: the levels where a
    /// deadline may have passed are pruned, and requests whose client left are dropped from the
    /// front of each lane (one further back is skipped by the batcher when its batch runs).
    fn expire(&mut self, now: Instant) {
        for i in 0..self.levels.len() {
            if self.levels[i].due.is_some_and(|d| d <= now) {
                self.prune_level(i, now);
            }
            let dropped = self.levels[i].drop_closed_fronts();
            self.cancelled += dropped as u64;
            self.len -= dropped;
        }
    }

    fn prune_level(&mut self, index: usize, now: Instant) {
        let gone = |p: &Pending| p.reply.is_closed() || p.deadline.is_some_and(|d| d <= now);
        let level = &mut self.levels[index];
        // Nearly always nothing to do; rebuild the level only when something must go.
        if !level.iter().any(gone) {
            level.due = level.earliest_deadline();
            return;
        }
        let before = level.len;
        let mut late = Vec::new();
        for lane in level.lanes.values_mut() {
            let mut kept = VecDeque::with_capacity(lane.queue.len());
            for (arrival, p) in lane.queue.drain(..) {
                if p.reply.is_closed() {
                    self.cancelled += 1;
                } else if p.deadline.is_none_or(|d| d > now) {
                    kept.push_back((arrival, p));
                } else {
                    late.push((arrival, p));
                }
            }
            lane.queue = kept;
        }
        late.sort_unstable_by_key(|(arrival, _)| *arrival);
        for (_, p) in late {
            if level.policy.timeout_action == TimeoutAction::Delay {
                self.delayed += 1;
                level.delayed.push_back(Pending { deadline: None, ..p });
            } else {
                self.expired += 1;
                let _ = p.reply.send(Err(Error::DeadlineExceeded("request timed out in the queue".into())));
            }
        }
        let delayed = level.delayed.len();
        level.delayed.retain(|p| !p.reply.is_closed());
        self.cancelled += (delayed - level.delayed.len()) as u64;
        level.recount();
        self.len -= before - level.len;
    }

    /// Decides what a free instance should run at `now`, merging at most `limit` rows (and the
    /// policy's max batch size); a single larger request still runs alone. `flush` sends what is
    /// pending without waiting for the queue delay (at shutdown).
    pub fn next_batch(&mut self, now: Instant, policy: &BatchPolicy, limit: usize, flush: bool) -> Decision {
        self.next_batch_of(now, policy, limit, flush, false, None)
    }

    /// As `next_batch`; with `light_only`, heavy requests are passed over (they wait for an
    /// instance that may take them), so an instance stays free for light work. With `hold`
    /// (rows, until), a batch of fewer rows waits for more until then (the batcher's, see
    /// `BatchCosts::hold`).
    pub fn next_batch_of(
        &mut self,
        now: Instant,
        policy: &BatchPolicy,
        limit: usize,
        flush: bool,
        light_only: bool,
        hold: Option<(usize, Instant)>,
    ) -> Decision {
        let limit = limit.min(policy.most_rows()).max(1);
        self.expire(now);
        if self.is_empty() {
            return Decision::Idle;
        }
        if light_only && self.levels.iter().flat_map(Level::iter).all(|p| p.heavy) {
            // Only heavy work is queued: look again when an instance running it is done.
            return Decision::WaitUntil(now + Duration::from_millis(20));
        }
        let light = |p: &Pending| !(light_only && p.heavy);
        // Priority, then turns within a level (`Level`), read in place; what the batch takes is
        // noted as it is read.
        let mut read: Vec<(usize, Spot)> = Vec::with_capacity(limit.min(64) + 1);
        let order =
            self.levels.iter().enumerate().flat_map(|(l, level)| level.turns(light).map(move |(spot, p)| (l, spot, p)));
        let order = order.map(|(l, spot, p)| {
            read.push((l, spot));
            p
        });
        let n = match batch_size(order, now, policy, limit, flush, hold) {
            Ok(n) => n,
            Err(wait) => return wait,
        };
        let places: Vec<(usize, Place)> = read[..n].iter().map(|&(l, spot)| (l, spot.place())).collect();
        Decision::Run(self.take(places))
    }

    /// The requests at `places` (level, place), in that order.
    fn take(&mut self, places: Vec<(usize, Place)>) -> Vec<Pending> {
        self.len -= places.len();
        // The usual batch: a run from the front of one lane.
        if let Some((level, Place::Lane(share, _))) = places.first() {
            let front = |(k, (l, place)): (usize, &(usize, Place))| {
                l == level && matches!(place, Place::Lane(s, i) if s == share && *i == k)
            };
            if places.iter().enumerate().all(front) {
                return self.levels[*level].take(Some(share), 0..places.len());
            }
        }
        let mut order: Vec<(usize, Place, usize)> =
            places.into_iter().enumerate().map(|(slot, (l, place))| (l, place, slot)).collect();
        order.sort_unstable();
        let mut out: Vec<Option<Pending>> = order.iter().map(|_| None).collect();
        for group in order.chunk_by(|a, b| a.0 == b.0 && a.1.lane() == b.1.lane()) {
            let positions = group.iter().map(|(_, place, _)| match place {
                Place::Lane(_, i) | Place::Delayed(i) => *i,
            });
            let taken = self.levels[group[0].0].take(group[0].1.lane(), positions);
            for (p, (_, _, slot)) in taken.into_iter().zip(group) {
                out[*slot] = Some(p);
            }
        }
        out.into_iter().map(|p| p.expect("every place taken")).collect()
    }
}

/// How many of the requests in `order` (the queue's, first the batch's first) the next batch
/// takes at `now`, or what to do instead: the longest run of requests compatible with the first
/// that fits `limit`, or fewer (a preferred size) or none yet (`WaitUntil`) within the policy's
/// queue delay and the batcher's `hold` (see `Queue::next_batch_of`).
fn batch_size<'a>(
    mut order: impl Iterator<Item = &'a Pending>,
    now: Instant,
    policy: &BatchPolicy,
    limit: usize,
    flush: bool,
    hold: Option<(usize, Instant)>,
) -> std::result::Result<usize, Decision> {
    let Some(first) = order.next() else {
        return Err(Decision::Idle);
    };
    if !policy.dynamic {
        return Ok(1);
    }
    let mut total = first.rows;
    let mut sums = vec![total];
    let mut oldest = first.enqueued;
    for p in order {
        if total + p.rows > limit || !first.compatible(p) {
            break;
        }
        total += p.rows;
        sums.push(total);
        oldest = oldest.min(p.enqueued);
    }
    if let Some((rows, until)) = hold {
        if !flush && !first.warmup && total < rows.min(limit) && now < until {
            return Err(Decision::WaitUntil(until));
        }
    }
    let due = oldest + Duration::from_micros(policy.max_queue_delay_us);
    if flush || first.warmup || total >= limit || policy.max_queue_delay_us == 0 || now >= due {
        Ok(sums.len())
    } else if let Some(j) = sums.iter().rposition(|s| policy.preferred_batch_sizes.contains(s)) {
        Ok(j + 1)
    } else {
        Err(Decision::WaitUntil(due))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataType;

    fn policy(max: usize, delay_us: u64, preferred: &[usize]) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: max,
            merge_limit: max,
            dynamic: true,
            preferred_batch_sizes: preferred.to_vec(),
            max_queue_delay_us: delay_us,
            priority_levels: 2,
            ..BatchPolicy::default()
        }
    }

    #[test]
    fn batches_stop_at_the_measured_limit_and_a_larger_request_runs_alone() {
        let t = Instant::now();
        let mut q = queue(1, 16);
        let _held: Vec<Req> = [1, 1, 1, 3].iter().map(|&r| push(&mut q, t, r, 2, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), 2, false)), vec![1, 1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), 2, false)), vec![1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), 2, false)), vec![3]);
    }

    fn queue(levels: usize, capacity: usize) -> Queue {
        Queue::new(&vec![QueuePolicy { max_queue_size: capacity, ..QueuePolicy::default() }; levels])
    }

    struct Req {
        rx: oneshot::Receiver<Result<Vec<Tensor>>>,
    }

    fn push(q: &mut Queue, at: Instant, rows: usize, width: usize, level: usize) -> Req {
        push_as(q, at, rows, width, level, None).unwrap()
    }

    /// As `push`, a request of `share` (level 0, 4 wide), or its refusal.
    fn push_of(q: &mut Queue, rows: usize, share: Option<&str>) -> Result<Req> {
        push_as(q, Instant::now(), rows, 4, 0, share.map(Arc::from))
    }

    fn push_as(
        q: &mut Queue,
        at: Instant,
        rows: usize,
        width: usize,
        level: usize,
        share: Option<Arc<str>>,
    ) -> Result<Req> {
        let (p, req) = pending(at, rows, width, level, share);
        q.push(p)?;
        Ok(req)
    }

    fn pending(at: Instant, rows: usize, width: usize, level: usize, share: Option<Arc<str>>) -> (Pending, Req) {
        let (tx, rx) = oneshot::channel();
        let x = Tensor::from_le("x", DataType::Fp32, vec![rows, width], &vec![0f32; rows * width]);
        let p = Pending { level, enqueued: at, share, ..Pending::new(vec![x], rows, tx) };
        (p, Req { rx })
    }

    fn rows(d: Decision) -> Vec<usize> {
        match d {
            Decision::Run(b) => b.iter().map(|p| p.rows).collect(),
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    #[test]
    fn zero_delay_sends_what_is_pending() {
        let t = Instant::now();
        let mut q = queue(1, 100);
        let _r: Vec<_> = (0..3).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![1, 1, 1]);
        assert!(matches!(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false), Decision::Idle));
    }

    #[test]
    fn never_exceeds_max_batch() {
        let t = Instant::now();
        let mut q = queue(1, 100);
        let _r: Vec<_> = [3, 3, 3].iter().map(|&n| push(&mut q, t, n, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![3, 3]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![3]);
    }

    #[test]
    fn waits_for_delay_then_sends() {
        let t = Instant::now();
        let p = policy(8, 1000, &[]);
        let mut q = queue(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        match q.next_batch(t + Duration::from_micros(10), &p, usize::MAX, false) {
            Decision::WaitUntil(when) => assert_eq!(when, t + Duration::from_micros(1000)),
            other => panic!("{other:?}"),
        }
        let _b = push(&mut q, t + Duration::from_micros(500), 1, 4, 0);
        assert!(matches!(q.next_batch(t + Duration::from_micros(999), &p, usize::MAX, false), Decision::WaitUntil(_)));
        assert_eq!(rows(q.next_batch(t + Duration::from_micros(1000), &p, usize::MAX, false)), vec![1, 1]);
    }

    #[test]
    fn a_held_batch_waits_for_its_rows_until_the_hold_ends() {
        let t = Instant::now();
        let p = policy(8, 0, &[]);
        let until = t + Duration::from_micros(800);
        let mut q = queue(1, 100);
        let _r: Vec<_> = (0..2).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        let next = |q: &mut Queue, at: Instant, flush: bool| q.next_batch_of(at, &p, 8, flush, false, Some((4, until)));
        assert!(matches!(next(&mut q, t, false), Decision::WaitUntil(w) if w == until));
        // At the hold's end it runs what came; flushing (shutdown) never waits.
        assert_eq!(rows(next(&mut q, until, false)), vec![1, 1]);
        let _r: Vec<_> = (0..2).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(next(&mut q, t, true)), vec![1, 1]);
        // Once the rows it waits for are there, or the merge limit is, it runs at once.
        let _r: Vec<_> = (0..4).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(next(&mut q, t, false)), vec![1, 1, 1, 1]);
        let _r: Vec<_> = (0..2).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(q.next_batch_of(t, &p, 2, false, false, Some((4, until)))), vec![1, 1]);
    }

    #[test]
    fn flush_sends_without_waiting() {
        let t = Instant::now();
        let mut q = queue(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(8, 1_000_000, &[]), usize::MAX, true)), vec![1]);
    }

    #[test]
    fn full_batch_goes_before_the_delay() {
        let t = Instant::now();
        let mut q = queue(1, 100);
        let _r: Vec<_> = (0..4).map(|_| push(&mut q, t, 2, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 1_000_000, &[]), usize::MAX, false)), vec![2, 2, 2, 2]);
    }

    #[test]
    fn largest_reachable_preferred_size_goes_now() {
        let t = Instant::now();
        let p = policy(16, 1_000_000, &[2, 4]);
        let mut q = queue(1, 100);
        let _r: Vec<_> = (0..5).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &p, usize::MAX, false)), vec![1, 1, 1, 1]);
        // One left: no preferred size reachable, so it waits for the delay.
        assert!(matches!(q.next_batch(t, &p, usize::MAX, false), Decision::WaitUntil(_)));
    }

    #[test]
    fn different_non_batch_dims_do_not_mix() {
        let t = Instant::now();
        let mut q = queue(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        let _b = push(&mut q, t, 1, 5, 0);
        let _c = push(&mut q, t, 1, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![1]);
    }

    #[test]
    fn priority_levels_go_first_fifo_within() {
        let t = Instant::now();
        let mut q = queue(2, 100);
        let _low = push(&mut q, t, 1, 4, 1);
        let _high1 = push(&mut q, t + Duration::from_micros(1), 2, 4, 0);
        let _high2 = push(&mut q, t + Duration::from_micros(2), 3, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(5, 0, &[]), usize::MAX, false)), vec![2, 3]);
        assert_eq!(rows(q.next_batch(t, &policy(5, 0, &[]), usize::MAX, false)), vec![1]);
    }

    /// The share and rows of each request a decision runs.
    fn shares_of(d: Decision) -> Vec<(Option<String>, usize)> {
        match d {
            Decision::Run(b) => b.iter().map(|p| (p.share.as_deref().map(str::to_string), p.rows)).collect(),
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    #[test]
    fn shares_take_turns_by_rows_whatever_one_queued_first() {
        let mut q = queue(1, 100);
        let (a, b) = (Some("a".to_string()), Some("b".to_string()));
        let _a: Vec<Req> = (0..4).map(|_| push_of(&mut q, 2, a.as_deref()).unwrap()).collect();
        let _b = push_of(&mut q, 1, b.as_deref()).unwrap();
        let _none = push_of(&mut q, 1, None).unwrap();
        let next = |q: &mut Queue| shares_of(q.next_batch(Instant::now(), &policy(8, 0, &[]), 2, false));
        // b's and the one of no share go ahead of a's four queued before them: their turns end at
        // one row run, a's first at two.
        assert_eq!(next(&mut q), vec![(b.clone(), 1), (None, 1)]);
        assert_eq!(next(&mut q), vec![(a.clone(), 2)]);
        assert_eq!(next(&mut q), vec![(a.clone(), 2)]);
        // b's next two take turns with a's last two, though they came after them.
        let _b2 = push_of(&mut q, 2, b.as_deref()).unwrap();
        let _b3 = push_of(&mut q, 2, b.as_deref()).unwrap();
        assert_eq!(next(&mut q), vec![(a.clone(), 2)]);
        assert_eq!(next(&mut q), vec![(b.clone(), 2)]);
        assert_eq!(next(&mut q), vec![(a.clone(), 2)]);
        assert_eq!(next(&mut q), vec![(b.clone(), 2)]);
        assert!(q.is_empty() && q.rows() == 0);
        assert!(q.levels[0].shares.is_empty() && q.levels[0].lanes.is_empty());
    }

    #[test]
    fn a_share_that_comes_later_takes_its_turns_from_then_not_from_the_start() {
        let mut q = queue(1, 100);
        let (a, b, c) = (Some("a".to_string()), Some("b".to_string()), Some("c".to_string()));
        let _ab: Vec<Req> = (0..6)
            .flat_map(|_| [push_of(&mut q, 1, a.as_deref()).unwrap(), push_of(&mut q, 1, b.as_deref()).unwrap()])
            .collect();
        let next = |q: &mut Queue| shares_of(q.next_batch(Instant::now(), &policy(8, 0, &[]), 1, false)).remove(0).0;
        let first: Vec<_> = (0..4).map(|_| next(&mut q)).collect();
        assert_eq!(first, vec![a.clone(), b.clone(), a.clone(), b.clone()]);
        let _c: Vec<Req> = (0..3).map(|_| push_of(&mut q, 1, c.as_deref()).unwrap()).collect();
        let then: Vec<_> = (0..6).map(|_| next(&mut q)).collect();
        assert_eq!(
            then,
            vec![a.clone(), b.clone(), c.clone(), a, b, c],
            "c runs as many rows as the others from when it came"
        );
    }

    #[test]
    fn a_share_whose_short_requests_come_and_go_does_not_keep_a_long_one_waiting() {
        let mut q = queue(1, 100);
        let _a = push_of(&mut q, 8, Some("a")).unwrap();
        let next = |q: &mut Queue| shares_of(q.next_batch(Instant::now(), &policy(8, 0, &[]), 1, false)).remove(0);
        // b's one-row requests, one at a time: each goes ahead of a's 8 rows until b has run as
        // many rows as a's request holds (a share that comes back starts where the turns are, not
        // level with a again as if it had run nothing: then a never ran).
        let mut order = Vec::new();
        for _ in 0..10 {
            let _b = push_of(&mut q, 1, Some("b")).unwrap();
            order.push(next(&mut q).0.unwrap());
            if order.last().map(String::as_str) == Some("a") {
                break;
            }
        }
        assert_eq!(order, [vec!["b"; 7], vec!["a"]].concat());
    }

    #[test]
    fn the_rows_ahead_of_a_new_request_are_those_whose_turns_come_first() {
        let mut q = queue(1, 100);
        let (a, b) = (Some(Arc::<str>::from("a")), Some(Arc::<str>::from("b")));
        let _a: Vec<Req> = (0..5).map(|_| push_of(&mut q, 2, Some("a")).unwrap()).collect();
        // a alone: a's next waits for all ten rows (first come, first served); one of two rows of
        // another share, or of none, for a's first only (its turn ends with it, and a's came
        // first); one of one row for nothing.
        assert_eq!((q.rows_ahead(0, &a, 2), q.rows_ahead(0, &None, 2), q.rows_ahead(0, &b, 2)), (10, 2, 2));
        assert_eq!((q.rows_ahead(0, &None, 1), q.rows_ahead(0, &b, 1)), (0, 0));
        // Once b's first (one row) waits, b's next of two waits for it and for a's first.
        let _b = push_of(&mut q, 1, Some("b")).unwrap();
        assert_eq!(q.rows_ahead(0, &b, 2), 1 + 2);
        assert_eq!(q.rows_ahead(0, &a, 2), 11, "a's next comes after everything queued");
        // What the queue then runs agrees: b's, then a's first and second.
        let next = |q: &mut Queue| shares_of(q.next_batch(Instant::now(), &policy(8, 0, &[]), 2, false));
        assert_eq!(next(&mut q), vec![(Some("b".to_string()), 1)]);
        assert_eq!(next(&mut q), vec![(Some("a".to_string()), 2)]);
    }

    /// The turns read from the lanes' heads are those of their definition, read over every
    /// queued request: each request's key is its share's rows run plus its share's rows queued
    /// ahead of it and its own, the least first, then the earliest; a share that comes starts at the
    /// key of the last turn taken. Random requests of three shares and of none, 1-4 rows, and batches of
    /// 1-8 rows between them, against a plain model of that.
    #[test]
    fn turns_read_from_the_lanes_are_those_of_every_request_keyed() {
        let t = Instant::now();
        let mut q = queue(1, 64);
        let names = [None, Some("a"), Some("b"), Some("c")];
        // The model: (arrival, share, rows) in arrival order, and each waiting share's rows run.
        let mut model: Vec<(usize, Option<&str>, usize)> = Vec::new();
        let mut served: HashMap<Option<&str>, u64> = HashMap::new();
        let mut clock = 0;
        let mut held = Vec::new();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n) as usize
        };
        for arrival in 0..3000 {
            if random(3) > 0 {
                let (share, rows) = (names[random(4)], 1 + random(4));
                let (mut p, req) = pending(t, rows, 4, 0, share.map(Arc::from));
                p.id = Some(arrival.to_string());
                if q.push(p).is_ok() {
                    if !model.iter().any(|m| m.1 == share) {
                        served.insert(share, clock);
                    }
                    model.push((arrival, share, rows));
                    held.push(req);
                }
                continue;
            }
            let limit = 1 + random(8);
            let mut ahead: HashMap<Option<&str>, u64> = HashMap::new();
            let mut keyed: Vec<(u64, usize, usize)> = Vec::new();
            for (i, &(arrival, share, rows)) in model.iter().enumerate() {
                let key = ahead.entry(share).or_insert(served[&share]);
                *key += rows as u64;
                keyed.push((*key, arrival, i));
            }
            keyed.sort_unstable();
            let mut total = 0;
            let mut expected = Vec::new();
            for &(_, _, i) in &keyed {
                if !expected.is_empty() && total + model[i].2 > limit {
                    break;
                }
                total += model[i].2;
                expected.push(i);
            }
            let got: Vec<String> = match q.next_batch(t, &policy(64, 0, &[]), limit, false) {
                Decision::Run(batch) => batch.into_iter().map(|p| p.id.unwrap()).collect(),
                Decision::Idle => Vec::new(),
                other => panic!("expected a batch, got {other:?}"),
            };
            let want: Vec<String> = expected.iter().map(|&i| model[i].0.to_string()).collect();
            assert_eq!(got, want, "batch after arrival {arrival}");
            for &i in &expected {
                let lane = served.get_mut(&model[i].1).unwrap();
                *lane += model[i].2 as u64;
                clock = clock.max(*lane);
            }
            expected.sort_unstable();
            for i in expected.into_iter().rev() {
                model.remove(i);
            }
            served.retain(|share, _| model.iter().any(|m| m.1 == *share));
            assert_eq!((q.len(), q.rows()), (model.len(), model.iter().map(|m| m.2).sum()));
        }
    }

    #[test]
    fn a_share_holds_at_most_half_of_a_levels_places() {
        let mut q = queue(1, 4);
        let (a, b) = (Some("a".to_string()), Some("b".to_string()));
        let _held: Vec<Req> = (0..2).map(|_| push_of(&mut q, 1, a.as_deref()).unwrap()).collect();
        let e = push_of(&mut q, 1, a.as_deref()).err().expect("a third of a's is refused");
        assert!(e.to_string().contains("hold half of the queue"), "{e}");
        let _b: Vec<Req> = (0..2).map(|_| push_of(&mut q, 1, b.as_deref()).unwrap()).collect();
        assert!(push_of(&mut q, 1, None).err().expect("the level is full").to_string().contains("4 requests waiting"));
        // A request of a's whose client left frees its place.
        let mut q = queue(1, 4);
        let gone = push_of(&mut q, 1, a.as_deref()).unwrap();
        let _kept = push_of(&mut q, 1, a.as_deref()).unwrap();
        drop(gone);
        assert!(push_of(&mut q, 1, a.as_deref()).is_ok());
        // Requests of no share are bounded by the level alone.
        let mut q = queue(1, 4);
        let _none: Vec<Req> = (0..4).map(|_| push_of(&mut q, 1, None).unwrap()).collect();
    }

    #[test]
    fn full_queue_refuses_with_retry_after() {
        let t = Instant::now();
        let mut q = queue(1, 1);
        let _a = push(&mut q, t, 1, 4, 0);
        let (tx, _rx) = oneshot::channel();
        let extra = Pending { enqueued: t, ..Pending::new(vec![], 1, tx) };
        let err = q.push(extra).unwrap_err();
        assert!(matches!(err, Error::Unavailable { retry_after: Some(_), .. }));
    }

    #[test]
    fn expired_requests_are_rejected_never_run() {
        let t = Instant::now();
        let mut q = queue(1, 10);
        let (tx, mut rx) = oneshot::channel();
        let x = Tensor::from_le("x", DataType::Fp32, vec![1, 4], &[0f32; 4]);
        q.push(Pending { enqueued: t, deadline: Some(t + Duration::from_micros(100)), ..Pending::new(vec![x], 1, tx) })
            .unwrap();
        assert!(matches!(
            q.next_batch(t + Duration::from_micros(100), &policy(8, 0, &[]), usize::MAX, false),
            Decision::Idle
        ));
        assert!(matches!(rx.try_recv(), Ok(Err(Error::DeadlineExceeded(_)))));
        assert_eq!(q.expired, 1);
    }

    #[test]
    fn requests_whose_client_left_are_dropped() {
        let t = Instant::now();
        let mut q = queue(1, 10);
        let gone = push(&mut q, t, 1, 4, 0);
        let _kept = push(&mut q, t, 1, 4, 0);
        drop(gone.rx);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, false)), vec![1]);
        assert_eq!(q.cancelled, 1);
    }

    #[test]
    fn without_dynamic_batching_one_request_at_a_time() {
        let t = Instant::now();
        let mut q = queue(1, 10);
        let _r: Vec<_> = (0..2).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        let p = BatchPolicy { max_batch_size: 8, dynamic: false, ..BatchPolicy::default() };
        assert_eq!(rows(q.next_batch(t, &p, usize::MAX, false)), vec![1]);
    }

    fn timed(q: &mut Queue, at: Instant, level: usize, timeout_us: u64) -> oneshot::Receiver<Result<Vec<Tensor>>> {
        let (tx, rx) = oneshot::channel();
        let x = Tensor::from_le("x", DataType::Fp32, vec![1, 4], &[0f32; 4]);
        let deadline = Some(at + Duration::from_micros(timeout_us));
        q.push(Pending { level, enqueued: at, deadline, ..Pending::new(vec![x], 1, tx) }).unwrap();
        rx
    }

    #[test]
    fn row_counts_and_deadlines_are_kept_as_requests_come_and_go() {
        let t = Instant::now();
        let mut q = queue(2, 100);
        let counted = |q: &Queue| q.levels.iter().flat_map(Level::iter).map(|p| p.rows).sum::<usize>();
        let _a = push(&mut q, t, 3, 4, 0);
        let late = timed(&mut q, t, 1, 50);
        let _b = push(&mut q, t, 2, 4, 1);
        let gone = push(&mut q, t, 4, 4, 1);
        assert_eq!((q.rows(), q.rows_ahead(0, &None, 1), q.len()), (10, 3, 4));
        drop(gone.rx);
        // Before the deadline nothing is read but the fronts; after it, the level is pruned.
        assert_eq!(rows(q.next_batch(t, &policy(3, 0, &[]), usize::MAX, false)), vec![3]);
        assert_eq!((q.rows(), counted(&q), q.cancelled), (7, 7, 0));
        let _ = q.next_batch(t + Duration::from_micros(60), &policy(8, 1_000_000, &[]), usize::MAX, false);
        assert_eq!((q.expired, q.cancelled), (1, 1));
        assert_eq!((q.rows(), counted(&q), q.len()), (2, 2, 1));
        drop(late);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), usize::MAX, true)), vec![2]);
        assert_eq!((q.rows(), q.len(), q.is_empty()), (0, 0, true));
    }

    #[test]
    fn each_level_has_its_own_queue_cap() {
        let t = Instant::now();
        let small = QueuePolicy { max_queue_size: 1, ..QueuePolicy::default() };
        let mut q = Queue::new(&[QueuePolicy::default(), small]);
        let _a = push(&mut q, t, 1, 4, 1);
        let (tx, _rx) = oneshot::channel();
        let extra = Pending { level: 1, enqueued: t, ..Pending::new(vec![], 1, tx) };
        assert!(matches!(q.push(extra), Err(Error::Unavailable { .. })));
        // The other level still takes work.
        let _b = push(&mut q, t, 1, 4, 0);
        assert_eq!(q.len(), 2);
        assert_eq!(q.rows_ahead(0, &None, 1), 1);
        assert_eq!(q.rows_ahead(1, &None, 1), 2);
    }

    #[test]
    fn delay_keeps_late_requests_behind_those_in_time() {
        let t = Instant::now();
        let delay = QueuePolicy { timeout_action: TimeoutAction::Delay, ..QueuePolicy::default() };
        let mut q = Queue::new(&[delay.clone(), delay]);
        let mut late = timed(&mut q, t, 0, 10);
        let _fresh = push(&mut q, t + Duration::from_micros(5), 3, 4, 0);
        let _low = push(&mut q, t + Duration::from_micros(6), 2, 4, 1);
        // At t+20 the first request is late: not rejected, but it runs after the level's fresh one
        // and before the lower level.
        assert_eq!(
            rows(q.next_batch(t + Duration::from_micros(20), &policy(16, 0, &[]), usize::MAX, false)),
            vec![3, 1, 2]
        );
        assert!(late.try_recv().is_err(), "a delayed request is not answered with an error");
        assert_eq!((q.delayed, q.expired), (1, 0));
    }

    #[test]
    fn reject_fails_late_requests_at_their_level_only() {
        let t = Instant::now();
        let delay = QueuePolicy { timeout_action: TimeoutAction::Delay, ..QueuePolicy::default() };
        let mut q = Queue::new(&[QueuePolicy::default(), delay]);
        let mut high = timed(&mut q, t, 0, 10);
        let _low = timed(&mut q, t, 1, 10);
        assert_eq!(rows(q.next_batch(t + Duration::from_micros(20), &policy(16, 0, &[]), usize::MAX, false)), vec![1]);
        assert!(matches!(high.try_recv(), Ok(Err(Error::DeadlineExceeded(_)))));
        assert_eq!((q.delayed, q.expired), (1, 1));
    }

    #[test]
    fn request_timeouts_follow_the_level_policy() {
        let p = QueuePolicy { default_timeout_us: 1000, ..QueuePolicy::default() };
        assert_eq!(p.timeout(None), Some(Duration::from_micros(1000)));
        assert_eq!(p.timeout(Some(500)), Some(Duration::from_micros(500)));
        // A request may shorten the default, never lengthen it.
        assert_eq!(p.timeout(Some(5000)), Some(Duration::from_micros(1000)));
        let fixed = QueuePolicy { allow_timeout_override: false, ..p };
        assert_eq!(fixed.timeout(Some(500)), Some(Duration::from_micros(1000)));
        assert_eq!(QueuePolicy::default().timeout(Some(7)), Some(Duration::from_micros(7)));
        assert_eq!(QueuePolicy::default().timeout(None), None);
    }
}
