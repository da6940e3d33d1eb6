//! What forming a batch costs under the queue's lock when the queue is deep: a model's queue kept
//! full (1,024 one-row requests, the default `max_queue_size`) while batches of 2, 16 and 64 rows
//! are taken from it, the requests of no share, or of 2, 8 or 512 shares (tenants) taking turns.
//! Prints a markdown table: microseconds a batch (the decision, taking it, and queueing as many
//! new requests), the median of three runs.
//!
//! Usage: cargo run --release -p ferrite-core --example queue_depth

use std::{sync::Arc, time::Instant};

use ferrite_core::{
    engine::{
        queue::{Decision, Pending, Queue},
        spec::{BatchPolicy, QueuePolicy},
    },
    DataType, Tensor,
};

const DEPTH: usize = 1024;
const BATCHES: usize = 20_000;

fn pending(share: Option<Arc<str>>) -> (Pending, tokio::sync::oneshot::Receiver<ferrite_core::Result<Vec<Tensor>>>) {
    let (reply, rx) = tokio::sync::oneshot::channel();
    let x = Tensor::from_le("x", DataType::Fp32, vec![1, 4], &[0f32; 4]);
    let p = Pending { share, ..Pending::new(vec![x], 1, reply) };
    (p, rx)
}

/// Microseconds a batch of `limit` rows from a queue kept `DEPTH` deep with `shares` shares.
fn run(shares: usize, limit: usize) -> f64 {
    let names: Vec<Arc<str>> = (0..shares).map(|i| Arc::from(format!("tenant-{i}").as_str())).collect();
    let share = |k: usize| (shares > 0).then(|| names[k % shares].clone());
    let mut q = Queue::new(&[QueuePolicy { max_queue_size: DEPTH, ..QueuePolicy::default() }]);
    let policy = BatchPolicy {
        max_batch_size: limit,
        merge_limit: limit,
        dynamic: true,
        max_queue_delay_us: 0,
        ..BatchPolicy::default()
    };
    let mut waiting = Vec::with_capacity(DEPTH);
    let mut k = 0;
    let mut fill = |q: &mut Queue, waiting: &mut Vec<_>| {
        while q.len() < DEPTH {
            let (p, rx) = pending(share(k));
            k += 1;
            // A share past its half of the queue is refused; the next share's request comes.
            if q.push(p).is_ok() {
                waiting.push(rx);
            }
        }
    };
    fill(&mut q, &mut waiting);
    let start = Instant::now();
    for _ in 0..BATCHES {
        match q.next_batch(Instant::now(), &policy, limit, false) {
            Decision::Run(batch) => assert_eq!(batch.len(), limit),
            other => panic!("a deep queue forms a batch at once, not {other:?}"),
        }
        if waiting.len() > 4 * DEPTH {
            waiting.drain(..2 * DEPTH);
        }
        fill(&mut q, &mut waiting);
    }
    start.elapsed().as_secs_f64() * 1e6 / BATCHES as f64
}

fn main() {
    println!("| shares waiting | batch of 2: µs | batch of 16: µs | batch of 64: µs |");
    println!("|---|---:|---:|---:|");
    for shares in [0, 2, 8, 512] {
        let cells: Vec<String> = [2, 16, 64]
            .iter()
            .map(|&limit| {
                let mut runs: Vec<f64> = (0..3).map(|_| run(shares, limit)).collect();
                runs.sort_by(f64::total_cmp);
                format!("{:.1}", runs[1])
            })
            .collect();
        let label = if shares == 0 { "none (no tenants)".to_string() } else { shares.to_string() };
        println!("| {label} | {} |", cells.join(" | "));
    }
}
