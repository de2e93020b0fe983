//! How a benchmark's messages are spread over its keys: round-robin (every key equally busy) or
//! Zipf-skewed (a few hot keys, a long tail).
//!
//! With uniform keys and as many keys as lanes can run, per-key order costs nothing: no message
//! ever waits behind another of its key. Zipf keys make the hot keys' lanes the bottleneck, which
//! is what an ordered consumer must be measured against. The spread is a pure function of the
//! message's index, so a producer and a checker in another process agree on it.

use std::sync::Arc;

/// The key index of each message: `key_of(i)` for message `i`.
#[derive(Clone, Debug)]
pub struct KeySpread {
    keys: usize,
    /// Zipf's exponent and the cumulative probabilities of keys `0..keys` (key 0 the hottest).
    zipf: Option<(f64, Arc<[f64]>)>,
}

/// Why a spread cannot be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SpreadError {
    /// No keys.
    #[error("a key spread needs at least one key")]
    NoKeys,
    /// A Zipf exponent that is not a positive number.
    #[error("the Zipf exponent must be a positive number (got {0}); 1.0 is the usual skew")]
    Exponent(f64),
}

impl KeySpread {
    /// Message `i` has key `i % keys` (one key if `keys` is 0).
    pub fn uniform(keys: usize) -> Self {
        KeySpread {
            keys: keys.max(1),
            zipf: None,
        }
    }

    /// Key `k` (from 0) is drawn with probability proportional to `1 / (k + 1)^s`.
    pub fn zipf(keys: usize, s: f64) -> Result<Self, SpreadError> {
        if keys == 0 {
            return Err(SpreadError::NoKeys);
        }
        if !(s.is_finite() && s > 0.0) {
            return Err(SpreadError::Exponent(s));
        }
        let mut total = 0.0;
        let mut cumulative: Vec<f64> = (0..keys)
            .map(|k| {
                total += 1.0 / ((k + 1) as f64).powf(s);
                total
            })
            .collect();
        for c in &mut cumulative {
            *c /= total;
        }
        Ok(KeySpread {
            keys,
            zipf: Some((s, cumulative.into())),
        })
    }

    /// Uniform, or Zipf with exponent `s` when given.
    pub fn new(keys: usize, zipf: Option<f64>) -> Result<Self, SpreadError> {
        match zipf {
            None if keys == 0 => Err(SpreadError::NoKeys),
            None => Ok(Self::uniform(keys)),
            Some(s) => Self::zipf(keys, s),
        }
    }

    /// The number of keys messages may have.
    pub fn keys(&self) -> usize {
        self.keys
    }

    /// Zipf's exponent, if skewed.
    pub fn zipf_exponent(&self) -> Option<f64> {
        self.zipf.as_ref().map(|(s, _)| *s)
    }

    /// The key index of message `i`.
    pub fn key_of(&self, i: u64) -> usize {
        match &self.zipf {
            None => (i % self.keys as u64) as usize,
            Some((_, cumulative)) => {
                // A uniform draw in [0, 1) from the index alone (splitmix64's finaliser).
                let u = (mix(i) >> 11) as f64 / (1u64 << 53) as f64;
                cumulative.partition_point(|&c| c <= u).min(self.keys - 1)
            }
        }
    }

    /// How many of the first `messages` messages each key gets.
    pub fn counts(&self, messages: u64) -> Vec<u64> {
        let mut counts = vec![0u64; self.keys];
        for i in 0..messages {
            counts[self.key_of(i)] += 1;
        }
        counts
    }

    /// `uniform` or `zipf s=1`, for reports.
    pub fn describe(&self) -> String {
        match self.zipf_exponent() {
            None => "uniform".to_owned(),
            Some(s) => format!("zipf s={s}"),
        }
    }
}

fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_round_robin() {
        let s = KeySpread::uniform(3);
        let keys: Vec<usize> = (0..7).map(|i| s.key_of(i)).collect();
        assert_eq!(keys, [0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(s.counts(7), [3, 2, 2]);
    }

    #[test]
    fn zipf_follows_its_law() {
        let s = KeySpread::zipf(1_000, 1.0).unwrap();
        let n = 1_000_000;
        let counts = s.counts(n);
        assert_eq!(counts.iter().sum::<u64>(), n);
        // H(1000) = 7.4855: key 0 has 13.36 % of the messages, key 1 half of that, key 9 a tenth.
        let share = |k: usize| counts[k] as f64 / n as f64;
        assert!((share(0) - 0.1336).abs() < 0.003, "{}", share(0));
        assert!((share(1) / share(0) - 0.5).abs() < 0.03, "{}", share(1));
        assert!((share(9) / share(0) - 0.1).abs() < 0.01, "{}", share(9));
        assert!(counts[999] > 0 && counts[999] < counts[100]);
        // The same index always gets the same key (a producer and a checker agree).
        assert_eq!(s.counts(n), counts);
    }

    #[test]
    fn bad_spreads_are_refused() {
        assert_eq!(KeySpread::new(0, None).unwrap_err(), SpreadError::NoKeys);
        assert_eq!(KeySpread::zipf(0, 1.0).unwrap_err(), SpreadError::NoKeys);
        assert_eq!(KeySpread::zipf(10, 0.0).unwrap_err(), SpreadError::Exponent(0.0));
        assert!(KeySpread::zipf(10, f64::NAN).is_err());
        assert_eq!(KeySpread::new(1, Some(1.0)).unwrap().key_of(12345), 0);
    }
}
