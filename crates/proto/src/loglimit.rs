//! Log lines a stranger can cause, rate-limited: a client that repeats a refused connection or
//! a wrong proof must not fill the log (one did at 0.8 MB/s). What is held back is counted and
//! said on the next line let through.

use std::time::{Duration, Instant};

/// Lines let through per window, at most: [`REFUSALS_PER_WINDOW`] per [`REFUSAL_WINDOW`].
pub const REFUSALS_PER_WINDOW: u32 = 10;
/// The window of [`REFUSALS_PER_WINDOW`].
pub const REFUSAL_WINDOW: Duration = Duration::from_secs(10);

/// Lets through at most a burst of lines per window, counting the others. Time is an argument.
#[derive(Debug, Clone)]
pub struct LogLimit {
    burst: u32,
    window: Duration,
    /// When the current window began, and the lines let through in it.
    began: Option<Instant>,
    shown: u32,
    /// Lines held back since the last one let through.
    held: u64,
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit::new(REFUSALS_PER_WINDOW, REFUSAL_WINDOW)
    }
}

impl LogLimit {
    /// At most `burst` lines per `window`.
    pub fn new(burst: u32, window: Duration) -> Self {
        assert!(burst > 0, "a limit that lets nothing through hides every refusal");
        LogLimit { burst, window, began: None, shown: 0, held: 0 }
    }

    /// Whether a line may be logged `now`: `Some(note)` to append to it (empty, or how many were
    /// held back before it), `None` to hold it back.
    pub fn admit(&mut self, now: Instant) -> Option<String> {
        // Lines are held back only once a window's burst was shown, and said on the next one.
        debug_assert!(self.held == 0 || self.shown == self.burst, "lines held back while the burst lasts");
        if self.began.is_none_or(|b| now >= b + self.window) {
            (self.began, self.shown) = (Some(now), 0);
        }
        if self.shown == self.burst {
            self.held += 1;
            return None;
        }
        self.shown += 1;
        let held = std::mem::take(&mut self.held);
        debug_assert!(self.shown <= self.burst);
        Some(if held == 0 { String::new() } else { format!(" ({held} more like it not logged)") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_window_is_logged_and_the_rest_is_counted() {
        let t0 = crate::test_start();
        let mut limit = LogLimit::new(3, Duration::from_secs(10));
        let shown: Vec<Option<String>> = (0..1000).map(|_| limit.admit(t0)).collect();
        assert_eq!(shown.iter().flatten().count(), 3);
        assert!(shown[..3].iter().all(|s| s.as_deref() == Some("")));
        assert_eq!(limit.admit(t0 + Duration::from_secs(10)).as_deref(), Some(" (997 more like it not logged)"));
        assert_eq!(limit.admit(t0 + Duration::from_secs(11)).as_deref(), Some(""));
    }
}
