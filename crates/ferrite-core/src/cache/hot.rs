//! Which keys are hot: a count-min sketch of recent lookups, bounded (4 rows of 16384 saturating
//! 8-bit counters, 64 KB) whatever the number of keys, and halved every [`WINDOW`] lookups so it
//! follows what is hot now. A key's estimate never undercounts; collisions can only overcount,
//! and with half a lookup per counter per window a key seen once is hot by collisions alone with
//! a chance of about 1e-11.

use std::sync::Mutex;

use super::Key;

const ROWS: usize = 4;
const WIDTH: usize = 16384;
/// Lookups after which every counter is halved.
pub const WINDOW: u32 = WIDTH as u32 / 2;
/// Lookups within about a window (of every key's lookups) from which a key counts as hot.
pub const HOT: u8 = 4;

pub struct Heat(Mutex<Sketch>);

struct Sketch {
    rows: Box<[[u8; WIDTH]; ROWS]>,
    seen: u32,
    /// Keys that became hot since the counters were last halved.
    hot: u64,
}

/// The key's counter in each row: a key is already a 128-bit hash, so each row takes 14 of its bits.
fn slots(key: Key) -> [usize; ROWS] {
    std::array::from_fn(|i| ((key >> (i * 32)) as usize) & (WIDTH - 1))
}

impl Default for Heat {
    fn default() -> Heat {
        Heat(Mutex::new(Sketch { rows: Box::new([[0; WIDTH]; ROWS]), seen: 0, hot: 0 }))
    }
}

impl Heat {
    fn lock(&self) -> std::sync::MutexGuard<'_, Sketch> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one lookup of `key`; returns whether it is hot now.
    pub fn touch(&self, key: Key) -> bool {
        let mut s = self.lock();
        let slots = slots(key);
        let before = slots.iter().enumerate().map(|(i, &j)| s.rows[i][j]).min().unwrap_or(0);
        for (i, j) in slots.into_iter().enumerate() {
            // Conservative update: only the counters at the minimum grow, so collisions overcount less.
            if s.rows[i][j] == before {
                s.rows[i][j] = before.saturating_add(1);
            }
        }
        if before.saturating_add(1) == HOT {
            s.hot += 1;
        }
        s.seen += 1;
        if s.seen >= WINDOW {
            for row in s.rows.iter_mut() {
                for c in row.iter_mut() {
                    *c /= 2;
                }
            }
            s.seen = 0;
            s.hot = 0;
        }
        before.saturating_add(1) >= HOT
    }

    /// Whether `key` is hot, without counting a lookup.
    pub fn is_hot(&self, key: Key) -> bool {
        let s = self.lock();
        slots(key).iter().enumerate().map(|(i, &j)| s.rows[i][j]).min().unwrap_or(0) >= HOT
    }

    /// Keys that became hot in the current window (since the counters were last halved).
    pub fn hot_keys(&self) -> u64 {
        self.lock().hot
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_hot_after_repeated_lookups_and_cools_when_others_take_over() {
        let heat = Heat::default();
        let hot: Key = 0x1234_5678_9abc_def0_1122_3344_5566_7788;
        for n in 1..=HOT {
            assert_eq!(heat.touch(hot), n >= HOT, "lookup {n}");
        }
        assert!(heat.is_hot(hot) && heat.hot_keys() == 1);
        // Thousands of keys seen once each are not hot, and do not make the sketch forget at once.
        let mut x: Key = 7;
        for _ in 0..WINDOW - 2 * HOT as u32 {
            x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835).wrapping_add(1);
            heat.touch(x);
        }
        assert!(!heat.is_hot(x));
        assert!(heat.is_hot(hot));
        // Windows of other traffic halve its count until it is no longer hot.
        for _ in 0..3 * WINDOW {
            x = x.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835).wrapping_add(1);
            heat.touch(x);
        }
        assert!(!heat.is_hot(hot));
    }
}
