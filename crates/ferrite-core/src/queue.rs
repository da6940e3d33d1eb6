//! The per-model request queue and the rule that turns it into batches.
//!
//! Pure logic: the caller passes `now`, so every decision is testable without sleeping.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use crate::{config::BatchPolicy, Error, Result, Tensor};

/// How long a client refused for a full queue is told to wait.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// One admitted request waiting for an instance.
#[derive(Debug)]
pub struct Pending {
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
    /// The request's span, which the batch span that serves it links to.
    pub span: tracing::Span,
}

impl Pending {
    /// Whether `other` may share a batch with `self`: every non-batch dim equal.
    fn compatible(&self, other: &Pending) -> bool {
        self.inputs.iter().zip(&other.inputs).all(|(a, b)| a.shape.get(1..) == b.shape.get(1..))
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

#[derive(Debug)]
pub struct Queue {
    levels: Vec<VecDeque<Pending>>,
    len: usize,
    capacity: usize,
    /// Requests whose clients left before they ran.
    pub cancelled: u64,
    /// Requests that timed out while queued.
    pub expired: u64,
}

impl Queue {
    pub fn new(levels: usize, capacity: usize) -> Queue {
        Queue {
            levels: (0..levels.max(1)).map(|_| VecDeque::new()).collect(),
            len: 0,
            capacity,
            cancelled: 0,
            expired: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Admits `p`, or refuses it when the queue is full.
    pub fn push(&mut self, p: Pending) -> Result<()> {
        if self.len >= self.capacity {
            return Err(Error::unavailable(
                format!("queue full: {} requests waiting (max_queue_size)", self.len),
                Some(RETRY_AFTER),
            ));
        }
        let level = p.level.min(self.levels.len() - 1);
        self.levels[level].push_back(p);
        self.len += 1;
        Ok(())
    }

    /// Removes every queued request (for shutdown), highest priority first.
    pub fn drain(&mut self) -> Vec<Pending> {
        self.len = 0;
        self.levels.iter_mut().flat_map(|l| l.drain(..)).collect()
    }

    /// Drops requests whose client left and rejects those whose deadline passed.
    fn prune(&mut self, now: Instant) {
        for level in &mut self.levels {
            level.retain_mut(|p| {
                if p.reply.is_closed() {
                    self.cancelled += 1;
                    return false;
                }
                if p.deadline.is_some_and(|d| d <= now) {
                    self.expired += 1;
                    // Moving the sender out is not possible in retain; replace it with a closed one.
                    let (tx, _) = oneshot::channel();
                    let reply = std::mem::replace(&mut p.reply, tx);
                    let _ = reply.send(Err(Error::DeadlineExceeded("request timed out in the queue".into())));
                    return false;
                }
                true
            });
        }
        self.len = self.levels.iter().map(VecDeque::len).sum();
    }

    /// Decides what a free instance should run at `now`. `flush` sends what is pending without
    /// waiting for the queue delay (at shutdown).
    pub fn next_batch(&mut self, now: Instant, policy: &BatchPolicy, flush: bool) -> Decision {
        self.prune(now);
        let mut order = self.levels.iter().flatten();
        let Some(first) = order.next() else {
            return Decision::Idle;
        };
        if !policy.dynamic {
            return Decision::Run(self.pop(1));
        }
        // The longest run of compatible requests, in priority then arrival order, that fits.
        let mut total = first.rows;
        let mut sums = vec![total];
        let mut oldest = first.enqueued;
        for p in order {
            if total + p.rows > policy.max_batch_size || !first.compatible(p) {
                break;
            }
            total += p.rows;
            sums.push(total);
            oldest = oldest.min(p.enqueued);
        }
        let due = oldest + Duration::from_micros(policy.max_queue_delay_us);
        let n = if flush || total >= policy.max_batch_size || policy.max_queue_delay_us == 0 || now >= due {
            sums.len()
        } else if let Some(j) = sums.iter().rposition(|s| policy.preferred_batch_sizes.contains(s)) {
            j + 1
        } else {
            return Decision::WaitUntil(due);
        };
        Decision::Run(self.pop(n))
    }

    fn pop(&mut self, mut n: usize) -> Vec<Pending> {
        let mut out = Vec::with_capacity(n);
        for level in &mut self.levels {
            while n > 0 {
                match level.pop_front() {
                    Some(p) => {
                        out.push(p);
                        n -= 1;
                    }
                    None => break,
                }
            }
        }
        self.len -= out.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DataType;

    fn policy(max: usize, delay_us: u64, preferred: &[usize]) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: max,
            dynamic: true,
            preferred_batch_sizes: preferred.to_vec(),
            max_queue_delay_us: delay_us,
            max_queue_size: 100,
            priority_levels: 2,
            ..BatchPolicy::default()
        }
    }

    struct Req {
        rx: oneshot::Receiver<Result<Vec<Tensor>>>,
    }

    fn push(q: &mut Queue, at: Instant, rows: usize, width: usize, level: usize) -> Req {
        let (tx, rx) = oneshot::channel();
        let x = Tensor::from_le("x", DataType::Fp32, vec![rows, width], &vec![0f32; rows * width]);
        q.push(Pending {
            inputs: vec![x],
            rows,
            outputs: None,
            level,
            enqueued: at,
            deadline: None,
            reply: tx,
            span: tracing::Span::none(),
        })
        .unwrap();
        Req { rx }
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
        let mut q = Queue::new(1, 100);
        let _r: Vec<_> = (0..3).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![1, 1, 1]);
        assert!(matches!(q.next_batch(t, &policy(8, 0, &[]), false), Decision::Idle));
    }

    #[test]
    fn never_exceeds_max_batch() {
        let t = Instant::now();
        let mut q = Queue::new(1, 100);
        let _r: Vec<_> = [3, 3, 3].iter().map(|&n| push(&mut q, t, n, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![3, 3]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![3]);
    }

    #[test]
    fn waits_for_delay_then_sends() {
        let t = Instant::now();
        let p = policy(8, 1000, &[]);
        let mut q = Queue::new(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        match q.next_batch(t + Duration::from_micros(10), &p, false) {
            Decision::WaitUntil(when) => assert_eq!(when, t + Duration::from_micros(1000)),
            other => panic!("{other:?}"),
        }
        let _b = push(&mut q, t + Duration::from_micros(500), 1, 4, 0);
        assert!(matches!(q.next_batch(t + Duration::from_micros(999), &p, false), Decision::WaitUntil(_)));
        assert_eq!(rows(q.next_batch(t + Duration::from_micros(1000), &p, false)), vec![1, 1]);
    }

    #[test]
    fn flush_sends_without_waiting() {
        let t = Instant::now();
        let mut q = Queue::new(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(8, 1_000_000, &[]), true)), vec![1]);
    }

    #[test]
    fn full_batch_goes_before_the_delay() {
        let t = Instant::now();
        let mut q = Queue::new(1, 100);
        let _r: Vec<_> = (0..4).map(|_| push(&mut q, t, 2, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &policy(8, 1_000_000, &[]), false)), vec![2, 2, 2, 2]);
    }

    #[test]
    fn largest_reachable_preferred_size_goes_now() {
        let t = Instant::now();
        let p = policy(16, 1_000_000, &[2, 4]);
        let mut q = Queue::new(1, 100);
        let _r: Vec<_> = (0..5).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        assert_eq!(rows(q.next_batch(t, &p, false)), vec![1, 1, 1, 1]);
        // One left: no preferred size reachable, so it waits for the delay.
        assert!(matches!(q.next_batch(t, &p, false), Decision::WaitUntil(_)));
    }

    #[test]
    fn different_non_batch_dims_do_not_mix() {
        let t = Instant::now();
        let mut q = Queue::new(1, 100);
        let _a = push(&mut q, t, 1, 4, 0);
        let _b = push(&mut q, t, 1, 5, 0);
        let _c = push(&mut q, t, 1, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![1]);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![1]);
    }

    #[test]
    fn priority_levels_go_first_fifo_within() {
        let t = Instant::now();
        let mut q = Queue::new(2, 100);
        let _low = push(&mut q, t, 1, 4, 1);
        let _high1 = push(&mut q, t + Duration::from_micros(1), 2, 4, 0);
        let _high2 = push(&mut q, t + Duration::from_micros(2), 3, 4, 0);
        assert_eq!(rows(q.next_batch(t, &policy(5, 0, &[]), false)), vec![2, 3]);
        assert_eq!(rows(q.next_batch(t, &policy(5, 0, &[]), false)), vec![1]);
    }

    #[test]
    fn full_queue_refuses_with_retry_after() {
        let t = Instant::now();
        let mut q = Queue::new(1, 1);
        let _a = push(&mut q, t, 1, 4, 0);
        let (tx, _rx) = oneshot::channel();
        let extra = Pending {
            inputs: vec![],
            rows: 1,
            outputs: None,
            level: 0,
            enqueued: t,
            deadline: None,
            reply: tx,
            span: tracing::Span::none(),
        };
        let err = q.push(extra).unwrap_err();
        assert!(matches!(err, Error::Unavailable { retry_after: Some(_), .. }));
    }

    #[test]
    fn expired_requests_are_rejected_never_run() {
        let t = Instant::now();
        let mut q = Queue::new(1, 10);
        let (tx, mut rx) = oneshot::channel();
        q.push(Pending {
            inputs: vec![Tensor::from_le("x", DataType::Fp32, vec![1, 4], &[0f32; 4])],
            rows: 1,
            outputs: None,
            level: 0,
            enqueued: t,
            deadline: Some(t + Duration::from_micros(100)),
            reply: tx,
            span: tracing::Span::none(),
        })
        .unwrap();
        assert!(matches!(q.next_batch(t + Duration::from_micros(100), &policy(8, 0, &[]), false), Decision::Idle));
        assert!(matches!(rx.try_recv(), Ok(Err(Error::DeadlineExceeded(_)))));
        assert_eq!(q.expired, 1);
    }

    #[test]
    fn requests_whose_client_left_are_dropped() {
        let t = Instant::now();
        let mut q = Queue::new(1, 10);
        let gone = push(&mut q, t, 1, 4, 0);
        let _kept = push(&mut q, t, 1, 4, 0);
        drop(gone.rx);
        assert_eq!(rows(q.next_batch(t, &policy(8, 0, &[]), false)), vec![1]);
        assert_eq!(q.cancelled, 1);
    }

    #[test]
    fn without_dynamic_batching_one_request_at_a_time() {
        let t = Instant::now();
        let mut q = Queue::new(1, 10);
        let _r: Vec<_> = (0..2).map(|_| push(&mut q, t, 1, 4, 0)).collect();
        let p = BatchPolicy { max_batch_size: 8, dynamic: false, ..BatchPolicy::default() };
        assert_eq!(rows(q.next_batch(t, &p, false)), vec![1]);
    }
}
