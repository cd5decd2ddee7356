//! One rollout device in virtual time: continuous batching of up to `max_batch` sequences, a
//! decode step costing `decode_step(batch)`, prefill of admitted prompts and weight loads paid
//! before decoding goes on. The same model the Python emulation runs in real time.

use std::collections::VecDeque;

use crate::costs::Rollout;

/// Float slack when crediting whole decode steps at an event's exact time.
const EPS: f64 = 1e-9;

/// What is left of a debt once paid up to an event's time: a remainder below `EPS` is rounding
/// (`(t + d) - t` can fall short of `d`), and kept it would schedule the device's next event at
/// the time it already is, forever.
fn settle(left: f64) -> f64 {
    if left < EPS { 0.0 } else { left }
}

#[derive(Debug, Clone, Copy)]
struct Sequence {
    remaining: u64,
    prompt_tokens: u64,
    call: usize,
}

/// Time a device spent, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTime {
    /// Decoding or prefilling.
    pub busy: f64,
    /// Loading weights.
    pub loading: f64,
    /// Sum over busy time of the batch's fill (sequences in flight ÷ `max_batch`).
    pub filled: f64,
}

#[derive(Debug)]
pub struct DecodeDevice {
    cost: Rollout,
    queue: VecDeque<Sequence>,
    active: Vec<Sequence>,
    /// Weight loading owed before anything else.
    load_debt: f64,
    /// Prefill owed before decoding goes on.
    prefill_debt: f64,
    /// Time already spent on the decode step in progress.
    carry: f64,
    /// Nothing progresses before this time (the pool is moving to generation).
    held_until: f64,
    last: f64,
    /// Policy version of the weights loaded.
    pub version: u64,
    /// Time spent inside the measured window.
    pub time: DeviceTime,
    window: (f64, f64),
}

impl DecodeDevice {
    pub fn new(cost: Rollout) -> Self {
        Self {
            cost,
            queue: VecDeque::new(),
            active: Vec::new(),
            load_debt: 0.0,
            prefill_debt: 0.0,
            carry: 0.0,
            held_until: 0.0,
            last: 0.0,
            version: 0,
            time: DeviceTime::default(),
            window: (f64::INFINITY, f64::INFINITY),
        }
    }

    /// Only time inside `[start, end]` is counted in [`DecodeDevice::time`].
    pub fn measure(&mut self, start: f64, end: f64) {
        self.window = (start, end);
    }

    /// Sequences waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Queues one call's sequences (response lengths in tokens).
    pub fn submit(&mut self, now: f64, lengths: &[u64], prompt_tokens: u64, call: usize) {
        self.queue.extend(lengths.iter().map(|&remaining| Sequence {
            remaining,
            prompt_tokens,
            call,
        }));
        self.admit();
        self.last = self.last.max(now);
    }

    /// Loads weights: nothing decodes for `seconds`.
    pub fn load(&mut self, version: u64, seconds: f64) {
        self.version = version;
        self.load_debt += seconds;
    }

    /// Nothing progresses before `until`.
    pub fn hold(&mut self, until: f64) {
        self.held_until = self.held_until.max(until);
    }

    fn admit(&mut self) {
        while self.active.len() < self.cost.max_batch {
            let Some(seq) = self.queue.pop_front() else { break };
            self.prefill_debt += seq.prompt_tokens as f64 / self.cost.prefill_tokens_per_s;
            self.active.push(seq);
        }
    }

    /// When the next sequence finishes (or the load owed ends), if the device has work.
    pub fn next_event(&self) -> Option<f64> {
        let start = self.last.max(self.held_until);
        if self.active.is_empty() {
            return (self.load_debt > 0.0).then_some(start + self.load_debt);
        }
        let step = self.cost.decode_step(self.active.len());
        let soonest = self.active.iter().map(|s| s.remaining).min().unwrap_or(0);
        Some(
            start
                + self.load_debt
                + self.prefill_debt
                + (soonest as f64 * step - self.carry).max(0.0),
        )
    }

    /// Counts `[from, to]` as time of one kind, clipped to the measured window.
    fn count(&mut self, from: f64, to: f64, loading: bool) {
        let (lo, hi) = self.window;
        let span = (to.min(hi) - from.max(lo)).max(0.0);
        if loading {
            self.time.loading += span;
        } else {
            self.time.busy += span;
            self.time.filled += span * self.active.len() as f64 / self.cost.max_batch as f64;
        }
    }

    /// Runs the device up to `now`; returns the calls of the sequences that finished, one entry
    /// per sequence.
    pub fn advance(&mut self, now: f64) -> Vec<usize> {
        let mut finished = Vec::new();
        let mut at = self.last.max(self.held_until);
        if now <= at {
            return finished;
        }
        let paid = self.load_debt.min(now - at);
        self.count(at, at + paid, true);
        self.load_debt = settle(self.load_debt - paid);
        at += paid;
        while at < now && !self.active.is_empty() {
            let prefill = self.prefill_debt.min(now - at);
            self.count(at, at + prefill, false);
            self.prefill_debt = settle(self.prefill_debt - prefill);
            at += prefill;
            let step = self.cost.decode_step(self.active.len());
            let soonest = self.active.iter().map(|s| s.remaining).min().unwrap_or(0);
            let budget = now - at + self.carry;
            let steps = ((budget / step + EPS).floor() as u64).min(soonest);
            if steps == 0 {
                self.count(at, now, false);
                self.carry = budget;
                break;
            }
            let spent = steps as f64 * step - self.carry;
            self.count(at, at + spent, false);
            at += spent;
            self.carry = 0.0;
            for seq in &mut self.active {
                seq.remaining -= steps;
            }
            finished.extend(self.active.iter().filter(|s| s.remaining == 0).map(|s| s.call));
            self.active.retain(|s| s.remaining > 0);
            self.admit();
        }
        if self.active.is_empty() {
            self.carry = 0.0;
        }
        self.last = now;
        finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost() -> Rollout {
        Rollout {
            max_batch: 2,
            decode_step_s: 0.01,
            decode_per_sequence_s: 0.0,
            prefill_tokens_per_s: 1e12,
            weight_load_s: 1.0,
        }
    }

    #[test]
    fn a_batch_decodes_together_and_refills_its_slots() {
        let mut d = DecodeDevice::new(cost());
        d.submit(0.0, &[10, 20, 5], 0, 7);
        // Slots hold the first two; the third waits for the first to finish (at 0.1 s).
        assert!((d.next_event().unwrap() - 0.1).abs() < 1e-9);
        assert_eq!(d.advance(0.1), vec![7]);
        // Now 10 tokens left on the second and 5 on the third.
        assert!((d.next_event().unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(d.advance(0.15), vec![7]);
        assert_eq!(d.advance(0.2), vec![7]);
        assert!(d.next_event().is_none());
    }

    #[test]
    fn a_weight_load_delays_decoding() {
        let mut d = DecodeDevice::new(cost());
        d.load(3, 1.0);
        d.submit(0.0, &[10], 0, 0);
        assert!((d.next_event().unwrap() - 1.1).abs() < 1e-9);
        assert!(d.advance(1.05).is_empty());
        assert_eq!(d.advance(1.1), vec![0]);
        assert_eq!(d.version, 3);
    }

    #[test]
    fn a_load_paid_at_its_end_leaves_no_event_behind() {
        // At this time, (t + 1.0) - t is 1.0 less a rounding error: the load must still count
        // as paid, or the device's next event would fall at the time it already is.
        let t = 127.530_985;
        assert!((t + 1.0) - t < 1.0);
        let mut d = DecodeDevice::new(cost());
        d.submit(t, &[], 0, 0);
        d.load(1, 1.0);
        let end = d.next_event().unwrap();
        assert!(d.advance(end).is_empty());
        assert_eq!(d.next_event(), None);
    }

    #[test]
    fn time_is_counted_inside_the_window_only() {
        let mut d = DecodeDevice::new(cost());
        d.measure(0.05, 1.0);
        d.submit(0.0, &[10, 10], 0, 0);
        d.advance(0.1);
        assert!((d.time.busy - 0.05).abs() < 1e-9);
        assert!((d.time.filled - 0.05).abs() < 1e-9);
    }
}
