//! Hysteresis for back-pressure: pause at the high-water mark, resume at the low-water mark.

/// What the caller must do to the transport after a count changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Stop fetching.
    Pause,
    /// Fetch again.
    Resume,
}

/// A high/low water gate over a count of held messages.
#[derive(Clone, Copy, Debug)]
pub struct Gate {
    high: usize,
    low: usize,
    paused: bool,
}

impl Gate {
    /// A gate that pauses at `high` and resumes at `low` (`low < high`).
    pub fn new(high: usize, low: usize) -> Self {
        Gate {
            high,
            low,
            paused: false,
        }
    }

    /// Feeds the current count; returns a transition when the gate flips.
    pub fn update(&mut self, held: usize) -> Option<Flow> {
        if !self.paused && held >= self.high {
            self.paused = true;
            Some(Flow::Pause)
        } else if self.paused && held <= self.low {
            self.paused = false;
            Some(Flow::Resume)
        } else {
            None
        }
    }

    /// True while over the high-water mark and not yet back to the low one.
    pub fn is_paused(&self) -> bool {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_at_high_and_resumes_only_at_low() {
        let mut g = Gate::new(10, 4);
        assert_eq!(g.update(9), None);
        assert_eq!(g.update(10), Some(Flow::Pause));
        assert_eq!(g.update(12), None);
        assert_eq!(g.update(5), None, "between the marks the gate stays shut");
        assert_eq!(g.update(4), Some(Flow::Resume));
        assert_eq!(g.update(9), None);
        assert!(!g.is_paused());
    }
}
