//! The largest differencing method (Karmarkar–Karp) for k-way partitioning. Every unit starts as
//! a k-tuple of part loads (itself and k − 1 empty parts); the two tuples whose spread (heaviest
//! minus lightest part) is widest are repeatedly merged, the heaviest part of one joining the
//! lightest of the other, until one tuple is left: its k parts are the answer. Settling the wide
//! spreads first leaves the many small units to even out what remains.
//!
//! With `balanced`, the units are first dealt, heaviest first, into tuples of k (one per part);
//! every merge then adds one unit to each part, so part sizes differ by at most one.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const NONE: u32 = u32::MAX;

/// A part under construction: its load and its units as a linked list through `next`.
#[derive(Debug, Clone, Copy)]
struct Part {
    load: f64,
    head: u32,
    tail: u32,
}

/// The parts of one tuple, heaviest first. Parts not listed are empty: early tuples hold few
/// units, and keeping them short keeps their merges cheap.
type Tuple = Vec<Part>;

/// Where the next-widest tuple comes from. Single units are not put in the heap: they are
/// already in descending order, and most merges take one of them.
enum Widest {
    Unit(u32),
    Merged(usize),
}

struct Differencing<'a> {
    costs: &'a [f64],
    k: usize,
    /// Units not yet merged, heaviest first, from `unit_at` on.
    order: &'a [u32],
    unit_at: usize,
    next: Vec<u32>,
    /// Merged tuples; slots of tuples merged away are reused, with their buffers.
    tuples: Vec<Tuple>,
    free: Vec<usize>,
    heap: BinaryHeap<(u64, Reverse<usize>)>,
    /// The tuple merged last, kept out of the heap: it is usually the next widest (a tuple
    /// still filling its parts keeps its spread), which saves a heap push and pop per merge.
    last: Option<(u64, usize)>,
    scratch: Tuple,
}

/// Assigns each unit to one of `k` parts; `order` lists the units heaviest first.
pub(super) fn differencing(costs: &[f64], order: &[u32], k: usize, balanced: bool) -> Vec<u32> {
    let n = costs.len();
    if k == 1 || n == 0 {
        return vec![0; n];
    }
    let mut state = Differencing {
        costs,
        k,
        order,
        unit_at: 0,
        next: vec![NONE; n],
        tuples: Vec::new(),
        free: Vec::new(),
        heap: BinaryHeap::new(),
        last: None,
        scratch: Vec::with_capacity(k),
    };
    if balanced {
        for chunk in order.chunks(k) {
            let tuple: Tuple = chunk.iter().map(|&u| state.single(u)).collect();
            state.store(tuple);
        }
        state.unit_at = order.len();
    }
    while state.tuples_left() > 1 {
        let (a, b) = (state.pop(), state.pop());
        state.merge(a, b);
    }
    let last = match state.pop() {
        Widest::Unit(u) => vec![state.single(u)],
        Widest::Merged(slot) => std::mem::take(&mut state.tuples[slot]),
    };
    let mut assignment = vec![0u32; n];
    for (part, p) in last.iter().enumerate() {
        let mut u = p.head;
        while u != NONE {
            assignment[u as usize] = part as u32;
            u = state.next[u as usize];
        }
    }
    assignment
}

impl Differencing<'_> {
    fn single(&self, u: u32) -> Part {
        Part { load: self.costs[u as usize], head: u, tail: u }
    }

    /// The tuple's spread as a key that orders like the number: loads are never negative, and
    /// the bit patterns of non-negative floats sort as the floats do.
    fn spread_key(&self, t: &Tuple) -> u64 {
        let lightest = if t.len() < self.k { 0.0 } else { t[self.k - 1].load };
        (t[0].load - lightest).max(0.0).to_bits()
    }

    fn tuples_left(&self) -> usize {
        self.heap.len() + usize::from(self.last.is_some()) + (self.order.len() - self.unit_at)
    }

    fn store(&mut self, tuple: Tuple) {
        let key = self.spread_key(&tuple);
        let slot = if let Some(slot) = self.free.pop() {
            self.tuples[slot] = tuple;
            slot
        } else {
            self.tuples.push(tuple);
            self.tuples.len() - 1
        };
        if let Some((key, slot)) = self.last.replace((key, slot)) {
            self.heap.push((key, Reverse(slot)));
        }
    }

    /// The widest of: the next single unit, the last merged tuple, the heap's widest. Ties go
    /// to merged tuples, then to the last merged one, so the result is deterministic.
    fn pop(&mut self) -> Widest {
        let unit = self.order.get(self.unit_at).map(|&u| (self.costs[u as usize].to_bits(), u));
        let top = self.heap.peek().map(|&(key, Reverse(slot))| (key, slot));
        let merged = match (self.last, top) {
            (Some(last), Some(top)) if top.0 > last.0 => Some((top, false)),
            (Some(last), _) => Some((last, true)),
            (None, top) => top.map(|t| (t, false)),
        };
        match (unit, merged) {
            (Some((key, u)), Some(((widest, _), _))) if key > widest => {
                self.unit_at += 1;
                Widest::Unit(u)
            }
            (Some((_, u)), None) => {
                self.unit_at += 1;
                Widest::Unit(u)
            }
            (_, Some(((_, slot), true))) => {
                self.last = None;
                Widest::Merged(slot)
            }
            (_, Some(((_, slot), false))) => {
                self.heap.pop();
                Widest::Merged(slot)
            }
            (None, None) => unreachable!("pop is only called while tuples are left"),
        }
    }

    fn merge(&mut self, a: Widest, b: Widest) {
        match (a, b) {
            (Widest::Unit(u), Widest::Unit(v)) => {
                // Both join empty parts; u was popped first, so it is the heavier. The buffer
                // of the slot `store` is about to reuse is recycled.
                let mut tuple = self.free.last().map_or_else(
                    || Vec::with_capacity(self.k),
                    |&slot| std::mem::take(&mut self.tuples[slot]),
                );
                tuple.clear();
                tuple.extend([self.single(u), self.single(v)]);
                self.store(tuple);
            }
            (Widest::Unit(u), Widest::Merged(slot)) | (Widest::Merged(slot), Widest::Unit(u)) => {
                let mut tuple = std::mem::take(&mut self.tuples[slot]);
                self.add_unit(&mut tuple, u);
                self.free.push(slot);
                self.store(tuple);
            }
            (Widest::Merged(x), Widest::Merged(y)) => {
                let merged = self.merge_tuples(x, y);
                self.free.push(y);
                self.free.push(x);
                self.store(merged);
            }
        }
    }

    /// A single unit joins the lightest part (an empty one if there is one).
    fn add_unit(&mut self, tuple: &mut Tuple, u: u32) {
        let part = self.single(u);
        if tuple.len() < self.k {
            let at = tuple.partition_point(|p| p.load >= part.load);
            tuple.insert(at, part);
            return;
        }
        let last = tuple.pop().expect("a full tuple");
        self.next[last.tail as usize] = u;
        let joined = Part { load: last.load + part.load, head: last.head, tail: u };
        let at = tuple.partition_point(|p| p.load >= joined.load);
        tuple.insert(at, joined);
    }

    /// Part i of the result joins the i-th heaviest part of tuple `wide` with the i-th lightest
    /// (empty ones included) of tuple `other`.
    fn merge_tuples(&mut self, wide: usize, other: usize) -> Tuple {
        let (heavy, light) = (&self.tuples[wide], &self.tuples[other]);
        let (k, lh, ll) = (self.k, heavy.len(), light.len());
        let out = &mut self.scratch;
        out.clear();
        // Position i pairs heavy[i] (if i < lh) with light[k − 1 − i] (if that is < ll).
        let first_joined = k - ll;
        out.extend_from_slice(&heavy[..lh.min(first_joined)]);
        for i in first_joined..lh {
            let (top, bottom) = (heavy[i], light[k - 1 - i]);
            self.next[top.tail as usize] = bottom.head;
            out.push(Part { load: top.load + bottom.load, head: top.head, tail: bottom.tail });
        }
        // The other tuple's heaviest parts, paired with empty ones.
        out.extend_from_slice(&light[..ll.min(k - lh)]);
        out.sort_unstable_by(|x, y| y.load.total_cmp(&x.load));
        // The old buffer of `wide` becomes the next scratch.
        let old = std::mem::take(&mut self.tuples[wide]);
        std::mem::replace(&mut self.scratch, old)
    }
}
