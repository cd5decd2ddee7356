//! A bitmap over row slots that grows at the back and drops whole words at the front, so the row
//! table can forget rows that are long gone without renumbering the ones that remain.

use std::collections::VecDeque;

#[derive(Debug, Clone, Default)]
pub struct Bitmap {
    words: VecDeque<u64>,
}

impl Bitmap {
    pub fn with_words(n: usize) -> Self {
        Self { words: std::iter::repeat_n(0, n).collect() }
    }

    pub fn words(&self) -> usize {
        self.words.len()
    }

    /// The word holding slots `64 * i .. 64 * i + 64` (zero beyond the end).
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        self.words.get(i).copied().unwrap_or(0)
    }

    pub fn resize_words(&mut self, n: usize) {
        self.words.resize(n, 0);
    }

    pub fn drop_front_words(&mut self, n: usize) {
        self.words.drain(..n.min(self.words.len()));
    }

    #[inline]
    pub fn get(&self, slot: usize) -> bool {
        self.word(slot / 64) & (1 << (slot % 64)) != 0
    }

    /// Sets the bit; returns whether it was clear before.
    #[inline]
    pub fn set(&mut self, slot: usize) -> bool {
        let w = &mut self.words[slot / 64];
        let mask = 1 << (slot % 64);
        let was_clear = *w & mask == 0;
        *w |= mask;
        was_clear
    }

    /// Clears the bit (ignoring slots past the end); returns whether it was set before.
    #[inline]
    pub fn clear(&mut self, slot: usize) -> bool {
        let Some(w) = self.words.get_mut(slot / 64) else {
            return false;
        };
        let mask = 1 << (slot % 64);
        let was_set = *w & mask != 0;
        *w &= !mask;
        was_set
    }

    pub fn count_ones(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_clear() {
        let mut b = Bitmap::with_words(2);
        assert!(b.set(3));
        assert!(!b.set(3));
        assert!(b.set(70));
        assert!(b.get(3) && b.get(70) && !b.get(4));
        assert_eq!(b.count_ones(), 2);
        assert!(b.clear(3));
        assert!(!b.clear(3));
        assert!(!b.clear(10_000));
        assert_eq!(b.word(1), 1 << 6);
    }

    #[test]
    fn dropping_front_words_shifts_slots() {
        let mut b = Bitmap::with_words(3);
        b.set(1);
        b.set(130);
        b.drop_front_words(2);
        assert_eq!(b.words(), 1);
        assert!(b.get(2));
        assert_eq!(b.count_ones(), 1);
    }
}
