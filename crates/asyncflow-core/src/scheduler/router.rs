//! Rollout routing: each new prompt group goes to the rollout engine with the least outstanding
//! work. Engines report their outstanding tokens and requests; between reports the router adds
//! what it has routed to them since, so a burst of routing does not pile onto one engine whose
//! last report looked light. An engine that stops reporting for `heartbeat_timeout` is taken
//! out of rotation and its unfinished work is routed elsewhere. Time is passed in.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::{Result, StoreError};

/// Outstanding work, as an engine reports it or as a prompt group adds to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    pub tokens: u64,
    pub requests: u64,
}

impl EngineLoad {
    fn add(&mut self, other: Self) {
        self.tokens += other.tokens;
        self.requests += other.requests;
    }

    fn sub(&mut self, other: Self) {
        self.tokens = self.tokens.saturating_sub(other.tokens);
        self.requests = self.requests.saturating_sub(other.requests);
    }
}

/// Work moved off an engine taken out of rotation; `to` is `None` when no engine was left to
/// take it (the router then forgets it, and the caller routes it again later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rerouted {
    pub work: u64,
    pub from: String,
    pub to: Option<String>,
}

/// An engine as the router sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineState {
    pub name: String,
    /// Last reported load plus work routed to it since.
    pub estimated: EngineLoad,
    pub in_rotation: bool,
    /// Work routed to it and not yet completed.
    pub assigned: usize,
}

#[derive(Debug)]
struct Engine {
    name: String,
    reported: EngineLoad,
    /// Work routed since the last report, which that report could not include.
    since_report: EngineLoad,
    /// Counts reports, so completed work knows whether a report has already accounted for it.
    epoch: u64,
    last_report: Instant,
    in_rotation: bool,
}

impl Engine {
    fn estimated(&self) -> EngineLoad {
        let mut load = self.reported;
        load.add(self.since_report);
        load
    }
}

#[derive(Debug, Clone, Copy)]
struct Assignment {
    engine: usize,
    load: EngineLoad,
    epoch: u64,
}

#[derive(Debug)]
pub struct Router {
    engines: Vec<Engine>,
    ids: HashMap<String, usize>,
    work: HashMap<u64, Assignment>,
    heartbeat_timeout: Duration,
}

impl Router {
    pub fn new(heartbeat_timeout: Duration) -> Result<Self> {
        if heartbeat_timeout.is_zero() {
            return Err(StoreError::bad_request("heartbeat_timeout must be positive"));
        }
        Ok(Self {
            engines: Vec::new(),
            ids: HashMap::new(),
            work: HashMap::new(),
            heartbeat_timeout,
        })
    }

    /// Puts an engine into rotation, with no load, as if it had just reported.
    pub fn add_engine(&mut self, name: &str, now: Instant) -> Result<()> {
        if name.is_empty() {
            return Err(StoreError::bad_request("an engine needs a non-empty name"));
        }
        if self.ids.contains_key(name) {
            return Err(StoreError::bad_request(format!("engine {name:?} is already registered")));
        }
        self.ids.insert(name.to_owned(), self.engines.len());
        self.engines.push(Engine {
            name: name.to_owned(),
            reported: EngineLoad::default(),
            since_report: EngineLoad::default(),
            epoch: 0,
            last_report: now,
            in_rotation: true,
        });
        Ok(())
    }

    fn engine_id(&self, name: &str) -> Result<usize> {
        self.ids
            .get(name)
            .copied()
            .ok_or_else(|| StoreError::bad_request(format!("unknown engine {name:?}")))
    }

    /// Records an engine's outstanding load; an engine out of rotation comes back into it.
    pub fn report(&mut self, name: &str, load: EngineLoad, now: Instant) -> Result<()> {
        let id = self.engine_id(name)?;
        let e = &mut self.engines[id];
        e.reported = load;
        e.since_report = EngineLoad::default();
        e.epoch += 1;
        e.last_report = e.last_report.max(now);
        e.in_rotation = true;
        Ok(())
    }

    fn alive(&self, id: usize, now: Instant) -> bool {
        let e = &self.engines[id];
        e.in_rotation && now < e.last_report + self.heartbeat_timeout
    }

    /// The live engine with the fewest estimated outstanding tokens (then requests, then the
    /// earliest registered).
    fn least_loaded(&self, now: Instant) -> Option<usize> {
        (0..self.engines.len()).filter(|&id| self.alive(id, now)).min_by_key(|&id| {
            let load = self.engines[id].estimated();
            (load.tokens, load.requests, id)
        })
    }

    fn assign(&mut self, work: u64, engine: usize, load: EngineLoad) {
        let e = &mut self.engines[engine];
        e.since_report.add(load);
        self.work.insert(work, Assignment { engine, load, epoch: e.epoch });
    }

    /// Routes a unit of work (e.g. a prompt group) with its expected load to the least-loaded
    /// live engine; returns its name, or `None` if no engine is live (nothing is recorded then).
    pub fn route(&mut self, work: u64, load: EngineLoad, now: Instant) -> Result<Option<&str>> {
        if self.work.contains_key(&work) {
            return Err(StoreError::bad_request(format!("work {work} is already routed")));
        }
        let Some(engine) = self.least_loaded(now) else {
            return Ok(None);
        };
        self.assign(work, engine, load);
        Ok(Some(&self.engines[engine].name))
    }

    /// Marks work finished; returns the engine it was assigned to.
    pub fn complete(&mut self, work: u64) -> Result<&str> {
        let a = self.work.remove(&work).ok_or_else(|| {
            StoreError::bad_request(format!("work {work} is not routed (or already completed)"))
        })?;
        let e = &mut self.engines[a.engine];
        // Work routed before the engine's last report is in that report; the next one drops it.
        if a.epoch == e.epoch {
            e.since_report.sub(a.load);
        }
        Ok(&e.name)
    }

    /// Takes every engine silent for `heartbeat_timeout` out of rotation and routes its
    /// unfinished work to the remaining engines, in work order.
    pub fn expire(&mut self, now: Instant) -> Vec<Rerouted> {
        let mut rerouted = Vec::new();
        for id in 0..self.engines.len() {
            if !self.engines[id].in_rotation || self.alive(id, now) {
                continue;
            }
            let e = &mut self.engines[id];
            e.in_rotation = false;
            e.reported = EngineLoad::default();
            e.since_report = EngineLoad::default();
            let mut orphans: Vec<(u64, EngineLoad)> = self
                .work
                .iter()
                .filter(|(_, a)| a.engine == id)
                .map(|(&w, a)| (w, a.load))
                .collect();
            orphans.sort_unstable_by_key(|&(w, _)| w);
            for (work, load) in orphans {
                self.work.remove(&work);
                let to = self.least_loaded(now);
                if let Some(to) = to {
                    self.assign(work, to, load);
                }
                rerouted.push(Rerouted {
                    work,
                    from: self.engines[id].name.clone(),
                    to: to.map(|t| self.engines[t].name.clone()),
                });
            }
        }
        rerouted
    }

    /// Every engine, in registration order.
    pub fn engines(&self) -> Vec<EngineState> {
        self.engines
            .iter()
            .enumerate()
            .map(|(id, e)| EngineState {
                name: e.name.clone(),
                estimated: e.estimated(),
                in_rotation: e.in_rotation,
                assigned: self.work.values().filter(|a| a.engine == id).count(),
            })
            .collect()
    }

    /// The engine `work` is assigned to, if it is routed and unfinished.
    pub fn assigned_to(&self, work: u64) -> Option<&str> {
        self.work.get(&work).map(|a| self.engines[a.engine].name.as_str())
    }
}
