//! Local search on a finished partition: take the heaviest part and either move one of its units
//! to a lighter part or swap one of its units for a lighter unit of another part, choosing the
//! change that brings the pair closest to even; repeat until no change lowers the heaviest part
//! or the work budget is spent. Every change strictly lowers the heaviest part involved, so the
//! result is never worse than the starting point.

/// One unit of a part, kept sorted by cost so that partners can be found by a linear merge.
type Member = (f64, u32);

/// Units looked at before giving up; bounds the time refinement may add to one partition.
pub(super) const DEFAULT_PROBES: usize = 40_000;

/// Partners tried after the first one that offers an improving change: the lightest parts offer
/// the most, and searching every part for a slightly better change costs more than it gains.
const MORE_PARTNERS: usize = 2;

/// What to change: move `a` from the heaviest part to `to`, or swap it with `b` of `to`.
#[derive(Debug, Clone, Copy)]
struct Change {
    gain: f64,
    to: usize,
    a: Member,
    b: Option<Member>,
}

/// Improves `assignment` (unit → part) in place. `allow_moves` is false when part sizes must stay
/// as they are (swaps keep them).
pub(super) fn refine(
    costs: &[f64],
    k: usize,
    assignment: &mut [u32],
    allow_moves: bool,
    mut probes: usize,
) {
    let mut parts: Vec<Vec<Member>> = vec![Vec::new(); k];
    let mut loads = vec![0.0f64; k];
    for (u, &p) in assignment.iter().enumerate() {
        parts[p as usize].push((costs[u], u as u32));
        loads[p as usize] += costs[u];
    }
    for part in &mut parts {
        part.sort_by(|x, y| x.0.total_cmp(&y.0));
    }
    // Parts by load, lightest first; a change moves only two of them, so it is kept up to date
    // rather than sorted again.
    let mut by_load: Vec<usize> = (0..k).collect();
    by_load.sort_by(|&x, &y| loads[x].total_cmp(&loads[y]));
    while probes > 0 {
        let (&p, partners) = by_load.split_last().expect("k >= 1");
        let Some(change) = best_change(&parts, &loads, p, partners, allow_moves, &mut probes)
        else {
            return;
        };
        apply(&mut parts, &mut loads, assignment, p, change);
        reposition(&mut by_load, &loads, p);
        reposition(&mut by_load, &loads, change.to);
    }
}

/// Moves `part` to its place in `by_load` after its load changed.
fn reposition(by_load: &mut Vec<usize>, loads: &[f64], part: usize) {
    let at = by_load.iter().position(|&x| x == part).expect("every part is listed");
    by_load.remove(at);
    let to = by_load.partition_point(|&x| loads[x] <= loads[part]);
    by_load.insert(to, part);
}

/// The change with the largest gain for heaviest part `p`, trying partners lightest first.
fn best_change(
    parts: &[Vec<Member>],
    loads: &[f64],
    p: usize,
    partners: &[usize],
    allow_moves: bool,
    probes: &mut usize,
) -> Option<Change> {
    // Gains below this are rounding noise, and taking them could cycle.
    let floor = loads[p] * 1e-12;
    let mut best: Option<Change> = None;
    let mut patience = MORE_PARTNERS;
    for &q in partners {
        let gap = loads[p] - loads[q];
        let best_gain = best.map_or(floor, |c| c.gain);
        // A change with partner q gains at most gap / 2; heavier partners have smaller gaps.
        if gap / 2.0 <= best_gain || *probes == 0 {
            break;
        }
        if best.is_some() {
            if patience == 0 {
                break;
            }
            patience -= 1;
        }
        let found = if allow_moves { best_move(&parts[p], gap, q) } else { None };
        let found = better(found, best_swap(&parts[p], &parts[q], gap, q));
        *probes = probes.saturating_sub(parts[p].len() + parts[q].len());
        if let Some(c) = found.filter(|c| c.gain > best_gain) {
            best = Some(c);
        }
    }
    best
}

fn better(x: Option<Change>, y: Option<Change>) -> Option<Change> {
    match (x, y) {
        (Some(a), Some(b)) => Some(if b.gain > a.gain { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Gain of shifting `delta` of load across a gap: the heavier side drops by `min(delta, gap −
/// delta)` at most, and only a shift strictly inside the gap helps.
fn gain(delta: f64, gap: f64) -> Option<f64> {
    (delta > 0.0 && delta < gap).then(|| delta.min(gap - delta))
}

/// Moving one unit of the heaviest part across a gap: best with cost nearest `gap / 2`.
fn best_move(from: &[Member], gap: f64, to: usize) -> Option<Change> {
    let at = from.partition_point(|m| m.0 < gap / 2.0);
    [at.checked_sub(1), Some(at)]
        .into_iter()
        .flatten()
        .filter_map(|i| from.get(i))
        .filter_map(|&a| gain(a.0, gap).map(|g| Change { gain: g, to, a, b: None }))
        .max_by(|x, y| x.gain.total_cmp(&y.gain))
}

/// Swapping unit a of the heaviest part for unit b of `other`: best with `a − b` nearest
/// `gap / 2`. Both lists ascend, so one merge-like pass finds every a's nearest b.
fn best_swap(heavy: &[Member], other: &[Member], gap: f64, to: usize) -> Option<Change> {
    let mut best: Option<Change> = None;
    let mut j = 0;
    for &a in heavy {
        let target = a.0 - gap / 2.0;
        while j < other.len() && other[j].0 < target {
            j += 1;
        }
        for i in [j.checked_sub(1), Some(j)].into_iter().flatten() {
            let Some(&b) = other.get(i) else { continue };
            if let Some(g) = gain(a.0 - b.0, gap)
                && best.is_none_or(|c| g > c.gain)
            {
                best = Some(Change { gain: g, to, a, b: Some(b) });
            }
        }
    }
    best
}

fn apply(
    parts: &mut [Vec<Member>],
    loads: &mut [f64],
    assignment: &mut [u32],
    p: usize,
    change: Change,
) {
    let Change { to: q, a, b, .. } = change;
    remove(&mut parts[p], a);
    insert(&mut parts[q], a);
    assignment[a.1 as usize] = q as u32;
    loads[p] -= a.0;
    loads[q] += a.0;
    if let Some(b) = b {
        remove(&mut parts[q], b);
        insert(&mut parts[p], b);
        assignment[b.1 as usize] = p as u32;
        loads[q] -= b.0;
        loads[p] += b.0;
    }
}

fn remove(part: &mut Vec<Member>, m: Member) {
    let from = part.partition_point(|x| x.0 < m.0);
    let at = from + part[from..].iter().position(|x| x.1 == m.1).expect("member is in its part");
    part.remove(at);
}

fn insert(part: &mut Vec<Member>, m: Member) {
    let at = part.partition_point(|x| x.0 <= m.0);
    part.insert(at, m);
}
