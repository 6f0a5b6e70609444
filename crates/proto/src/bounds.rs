//! Bounds that follow what is observed (`docs/protocol.md`, "Adaptive bounds"): how long to wait
//! for something that usually takes about the same time (a peer's next heartbeat, a collective
//! of one kind and size) is the median of its recent durations plus [`MADS`] median absolute
//! deviations, within a floor and a ceiling. A peer whose heartbeats come like clockwork is
//! given up on soon after they stop; one whose heartbeats have come late and unevenly all along
//! (a congested link, a loaded host) is given as long as its history says it needs, up to the
//! ceiling. The median and its deviation ignore a few outliers either way, which a mean and a
//! standard deviation would not.

use std::collections::VecDeque;
use std::time::Duration;

/// Durations remembered: the bound follows the most recent this many.
pub const WINDOW: usize = 64;

/// Durations seen before the bound follows them; until then it is the fallback.
pub const MIN_SAMPLES: usize = 8;

/// Median absolute deviations above the median: about 3.4 standard deviations of a normal
/// distribution, so a healthy duration passes the bound about once in 3,000.
pub const MADS: u32 = 5;

/// Recent durations of one thing and the bound they give.
#[derive(Debug, Clone)]
pub struct Observed {
    samples: VecDeque<Duration>,
    floor: Duration,
    ceiling: Duration,
    /// The fallback until [`MIN_SAMPLES`] were seen; then what they give.
    bound: Duration,
}

impl Observed {
    /// A bound between `floor` and `ceiling` once [`MIN_SAMPLES`] durations were seen, and
    /// `fallback` (clamped likewise) until then.
    pub fn new(floor: Duration, ceiling: Duration, fallback: Duration) -> Self {
        assert!(floor <= ceiling, "a floor above the ceiling: {floor:?} > {ceiling:?}");
        let fallback = fallback.clamp(floor, ceiling);
        Observed { samples: VecDeque::with_capacity(WINDOW), floor, ceiling, bound: fallback }
    }

    /// One more duration.
    pub fn observe(&mut self, d: Duration) {
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back(d);
        if self.samples.len() >= MIN_SAMPLES {
            let (median, mad) = median_and_mad(self.samples.iter().copied().collect());
            self.bound = median.saturating_add(mad.saturating_mul(MADS)).clamp(self.floor, self.ceiling);
        }
    }

    /// How long to wait now.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// How many durations it follows.
    pub fn samples(&self) -> usize {
        self.samples.len()
    }

    /// Its median and median absolute deviation, once it follows them.
    pub fn spread(&self) -> Option<(Duration, Duration)> {
        (self.samples.len() >= MIN_SAMPLES).then(|| median_and_mad(self.samples.iter().copied().collect()))
    }
}

/// The median of `v` (the lower of the middle two) and the median of the distances from it.
fn median_and_mad(mut v: Vec<Duration>) -> (Duration, Duration) {
    let middle = (v.len() - 1) / 2;
    let median = *v.select_nth_unstable(middle).1;
    let mut deviations: Vec<Duration> = v.iter().map(|d| d.abs_diff(median)).collect();
    let mad = *deviations.select_nth_unstable(middle).1;
    (median, mad)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_fallback_stands_until_enough_was_seen() {
        let mut o = Observed::new(100 * MS, 10_000 * MS, 1_500 * MS);
        for _ in 0..MIN_SAMPLES - 1 {
            o.observe(10 * MS);
            assert_eq!(o.bound(), 1_500 * MS);
        }
        o.observe(10 * MS);
        assert_eq!(o.bound(), 100 * MS, "steady and short: the floor");
        assert_eq!(Observed::new(100 * MS, 200 * MS, 1_500 * MS).bound(), 200 * MS, "clamped");
    }

    #[test]
    fn the_bound_is_the_median_plus_five_deviations() {
        let mut o = Observed::new(MS, 100_000 * MS, Duration::ZERO);
        // 1..=9 s: median 5 s, deviations 0..4 s twice, median 2 s.
        for s in 1..=9 {
            o.observe(1000 * s * MS);
        }
        assert_eq!(o.spread(), Some((5_000 * MS, 2_000 * MS)));
        assert_eq!(o.bound(), 15_000 * MS);
    }

    #[test]
    fn outliers_move_it_little_and_the_ceiling_holds() {
        let mut o = Observed::new(MS, 20_000 * MS, Duration::ZERO);
        for _ in 0..20 {
            o.observe(1000 * MS);
        }
        o.observe(3_600_000 * MS);
        assert_eq!(o.bound(), 1000 * MS, "one hour-long pause among steady seconds");
        for s in 0..WINDOW as u32 {
            o.observe(1000 * (1 + s % 30) * MS);
        }
        assert_eq!(o.bound(), 20_000 * MS, "spread out: up to the ceiling");
        assert_eq!(o.samples(), WINDOW, "the oldest are forgotten");
    }
}
