//! Deadlines that remember their bound, so a timeout error can say what the bound was.

use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// A point in time by which an operation must end, and the bound it was made from.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    bound: Duration,
}

impl Deadline {
    /// `bound` from now.
    pub fn after(bound: Duration) -> Self {
        Deadline { at: Instant::now() + bound, bound }
    }

    /// At `at`, made from `bound`.
    pub fn until(at: Instant, bound: Duration) -> Self {
        Deadline { at, bound }
    }

    /// The same deadline moved `by` later (the bound it reports grows too).
    pub fn extended(&self, by: Duration) -> Self {
        Deadline { at: self.at + by, bound: self.bound + by }
    }

    /// The bound this deadline was made from.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Time left, or [`Error::Timeout`] naming `operation` once none is.
    pub fn left(&self, operation: &'static str) -> Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout { operation, after: self.bound });
        }
        Ok(left)
    }
}
