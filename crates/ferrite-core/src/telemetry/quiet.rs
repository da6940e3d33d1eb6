//! Warnings that requests can cause, kept to a line a period: a client that sends request after
//! request failing in a model (an index out of an embedding's table, say) must not fill the
//! server's log, or its disk, at the rate it can send them.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

/// At most one line per `PERIOD`; the next line says how many were left out before it.
#[derive(Debug, Default)]
pub struct Quiet(Mutex<(Option<Instant>, u64)>);

/// How often a warning of one kind may be logged.
pub const PERIOD: Duration = Duration::from_secs(1);

impl Quiet {
    /// Whether a warning due now is logged: `Some(left out since the last line)`, or `None` (left
    /// out and counted).
    pub fn pass(&self, now: Instant) -> Option<u64> {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if s.0.is_some_and(|last| now.saturating_duration_since(last) < PERIOD) {
            s.1 += 1;
            return None;
        }
        s.0 = Some(now);
        Some(std::mem::take(&mut s.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_a_line_a_period_and_counts_the_rest() {
        let q = Quiet::default();
        let t = Instant::now();
        assert_eq!(q.pass(t), Some(0));
        let within: Vec<_> = (1..=999).map(|ms| q.pass(t + Duration::from_millis(ms))).collect();
        assert!(within.iter().all(Option::is_none));
        assert_eq!(q.pass(t + PERIOD), Some(999));
        assert_eq!(q.pass(t + PERIOD + Duration::from_millis(1)), None);
        // Quiet for a while: the next one is logged, with the one left out before it.
        assert_eq!(q.pass(t + 10 * PERIOD), Some(1));
        assert_eq!(q.pass(t + 12 * PERIOD), Some(0));
    }
}
