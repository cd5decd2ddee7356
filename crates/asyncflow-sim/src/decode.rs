//! One rollout device in virtual time: continuous batching of up to `max_batch` sequences, a
//! decode step costing `decode_step(batch)`, prefill of admitted prompts and weight loads paid
//! before decoding goes on. The same model the Python emulation runs in real time.
//!
//! Under partial rollout a newly published version is loaded between two decode steps while
//! sequences are in flight ([`DecodeDevice::load_between_steps`]), and each sequence remembers
//! the version that sampled its first (oldest) token.

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
    /// Response length in tokens.
    length: u64,
    prompt_tokens: u64,
    call: usize,
    /// Its place among its call's sequences.
    slot: usize,
    /// Version of the weights that sampled its first token, once it has one.
    first_version: Option<u64>,
}

impl Sequence {
    fn generated(&self) -> u64 {
        self.length - self.remaining
    }
}

/// A sequence that finished: its call, its place in the call, and the version of its oldest
/// token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub call: usize,
    pub slot: usize,
    pub version: u64,
}

/// A weight load waiting for the decode step in progress to end.
#[derive(Debug, Clone, Copy)]
struct PendingLoad {
    version: u64,
    seconds: f64,
    /// Abort: the sequences in flight are cut and their prefixes prefilled again.
    reprefill: bool,
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
    /// A load that starts when the decode step in progress ends.
    pending: Option<PendingLoad>,
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
            pending: None,
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

    /// Sequences decoding or waiting for a slot.
    pub fn in_flight(&self) -> usize {
        self.active.len() + self.queue.len()
    }

    /// The version that will sample the first token of a sequence submitted now: that of a load
    /// waiting for the step in progress to end, else the one loaded.
    pub fn next_version(&self) -> u64 {
        self.pending.map_or(self.version, |p| p.version)
    }

    /// Queues one call's sequences (response lengths in tokens).
    pub fn submit(&mut self, now: f64, lengths: &[u64], prompt_tokens: u64, call: usize) {
        self.queue.extend(lengths.iter().enumerate().map(|(slot, &length)| Sequence {
            remaining: length,
            length,
            prompt_tokens,
            call,
            slot,
            first_version: None,
        }));
        self.admit();
        self.last = self.last.max(now);
    }

    /// Loads weights: nothing decodes for `seconds`.
    pub fn load(&mut self, version: u64, seconds: f64) {
        self.version = version;
        self.load_debt += seconds;
    }

    /// Partial rollout: loads `version` (for `seconds`) at the next decode-step boundary, at
    /// once if no step is in progress; the sequences in flight go on afterwards. With
    /// `reprefill` (abort) they are cut and admitted again with their prefix: the prompt and the
    /// tokens generated so far are prefilled anew at `rollout.prefill_tokens_per_s`, the cost
    /// model's prefill rate (no other constant is involved). A sequence that has sampled no token
    /// yet is still owed its first prefill, which the cut does not repeat. Until the load, no
    /// queued sequence joins the batch, so its first token is sampled by the new version.
    pub fn load_between_steps(&mut self, version: u64, seconds: f64, reprefill: bool) {
        let load = PendingLoad { version, seconds, reprefill };
        if self.active.is_empty() || self.carry == 0.0 {
            self.apply(load);
        } else {
            // A later publication within the same step: one load, of the newest version.
            self.pending = Some(match self.pending {
                Some(p) => PendingLoad { version: p.version.max(version), ..p },
                None => load,
            });
        }
    }

    fn apply(&mut self, load: PendingLoad) {
        self.version = load.version;
        self.load_debt += load.seconds;
        if load.reprefill {
            let tokens: u64 = self
                .active
                .iter()
                .filter(|s| s.generated() > 0)
                .map(|s| s.prompt_tokens + s.generated())
                .sum();
            self.prefill_debt += tokens as f64 / self.cost.prefill_tokens_per_s;
        }
        self.admit();
    }

    /// Nothing progresses before `until`.
    pub fn hold(&mut self, until: f64) {
        self.held_until = self.held_until.max(until);
    }

    fn admit(&mut self) {
        if self.pending.is_some() {
            return;
        }
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
        if self.pending.is_some() {
            // The step in progress ends; the load starts there.
            return Some(start + self.load_debt + self.prefill_debt + (step - self.carry).max(0.0));
        }
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

    /// Runs the device up to `now`; returns the sequences that finished.
    pub fn advance(&mut self, now: f64) -> Vec<Finished> {
        let mut finished = Vec::new();
        let mut at = self.last.max(self.held_until);
        if now <= at {
            return finished;
        }
        loop {
            let paid = self.load_debt.min(now - at);
            self.count(at, at + paid, true);
            self.load_debt = settle(self.load_debt - paid);
            at += paid;
            if at >= now || self.active.is_empty() {
                break;
            }
            let prefill = self.prefill_debt.min(now - at);
            self.count(at, at + prefill, false);
            self.prefill_debt = settle(self.prefill_debt - prefill);
            at += prefill;
            let step = self.cost.decode_step(self.active.len());
            let soonest = self.active.iter().map(|s| s.remaining).min().unwrap_or(0);
            let budget = now - at + self.carry;
            let mut steps = ((budget / step + EPS).floor() as u64).min(soonest);
            if self.pending.is_some() {
                steps = steps.min(1); // the load waits for the end of the step in progress
            }
            if steps == 0 {
                self.count(at, now, false);
                self.carry = budget;
                break;
            }
            let spent = steps as f64 * step - self.carry;
            self.count(at, at + spent, false);
            at += spent;
            self.carry = 0.0;
            let version = self.version;
            for seq in &mut self.active {
                seq.remaining -= steps;
                seq.first_version.get_or_insert(version);
            }
            finished.extend(self.active.iter().filter(|s| s.remaining == 0).map(|s| Finished {
                call: s.call,
                slot: s.slot,
                version: s.first_version.unwrap_or(version),
            }));
            self.active.retain(|s| s.remaining > 0);
            if let Some(load) = self.pending.take() {
                self.apply(load);
            }
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

    fn calls(finished: Vec<Finished>) -> Vec<usize> {
        finished.into_iter().map(|f| f.call).collect()
    }

    #[test]
    fn a_batch_decodes_together_and_refills_its_slots() {
        let mut d = DecodeDevice::new(cost());
        d.submit(0.0, &[10, 20, 5], 0, 7);
        // Slots hold the first two; the third waits for the first to finish (at 0.1 s).
        assert!((d.next_event().unwrap() - 0.1).abs() < 1e-9);
        assert_eq!(calls(d.advance(0.1)), vec![7]);
        // Now 10 tokens left on the second and 5 on the third.
        assert!((d.next_event().unwrap() - 0.15).abs() < 1e-9);
        assert_eq!(calls(d.advance(0.15)), vec![7]);
        assert_eq!(calls(d.advance(0.2)), vec![7]);
        assert!(d.next_event().is_none());
    }

    #[test]
    fn a_weight_load_delays_decoding() {
        let mut d = DecodeDevice::new(cost());
        d.load(3, 1.0);
        d.submit(0.0, &[10], 0, 0);
        assert!((d.next_event().unwrap() - 1.1).abs() < 1e-9);
        assert!(d.advance(1.05).is_empty());
        assert_eq!(calls(d.advance(1.1)), vec![0]);
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

    #[test]
    fn continue_loads_at_the_step_boundary_and_goes_on() {
        let mut d = DecodeDevice::new(cost());
        d.submit(0.0, &[10], 0, 0);
        assert!(d.advance(0.025).is_empty()); // two steps done, the third half done
        d.load_between_steps(1, 1.0, false);
        assert_eq!((d.version, d.next_version()), (0, 1));
        assert!((d.next_event().unwrap() - 0.03).abs() < 1e-9);
        // Submitted while the load waits: it joins after the load, its first token version 1.
        d.submit(0.025, &[5], 0, 1);
        assert!(d.advance(0.03).is_empty());
        assert_eq!(d.version, 1);
        // The load (1 s), then five steps of both sequences.
        assert!((d.next_event().unwrap() - 1.08).abs() < 1e-9);
        assert_eq!(d.advance(1.08), vec![Finished { call: 1, slot: 0, version: 1 }]);
        // The first sequence's oldest token is still version 0's.
        assert!((d.next_event().unwrap() - 1.10).abs() < 1e-9);
        assert_eq!(d.advance(1.10), vec![Finished { call: 0, slot: 0, version: 0 }]);
    }

    #[test]
    fn abort_prefills_prompt_and_prefix_again() {
        let slow_prefill = Rollout { prefill_tokens_per_s: 100.0, ..cost() };
        let mut d = DecodeDevice::new(slow_prefill);
        d.submit(0.0, &[10], 10, 0); // 0.1 s of prefill, then 0.01 s a step
        assert!(d.advance(0.125).is_empty());
        d.load_between_steps(1, 1.0, true);
        assert!(d.advance(0.13).is_empty()); // three tokens generated, then the cut
        // Load 1 s, prefill of 10 + 3 tokens (0.13 s), the 7 steps left.
        assert!((d.next_event().unwrap() - (0.13 + 1.0 + 0.13 + 0.07)).abs() < 1e-9);
    }
}
