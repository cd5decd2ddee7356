//! The simulated cluster: the pipeline's roles as state machines over one real store index,
//! advanced by a discrete-event loop in virtual time.
//!
//! Data moves through the index as the real workers move it: the feeder puts prompt groups;
//! rollout devices claim them and put each call's responses into the partition of the prompts'
//! training step, tagged with the policy version they were generated with; reward, advantage,
//! reference and trainer claim, fill their field and ack. Reference and trainer share the
//! training pool and split each batch over its data-parallel ranks with the real scheduler.
//! Only the payload-free control plane runs: no bytes move.
//!
//! Under partial rollout (`async-<k>+continue`, `async-<k>+abort`) each rollout device is driven
//! request by request, as `asyncflow.workers.partial.PartialRollout` drives its engine: it keeps
//! up to `calls_per_device x groups_per_call x group_size` sequences in flight (decoding or
//! queued for a slot), admits a prompt group whenever its sequences fit, puts each group as soon
//! as its sequences are done, and loads every newly published version at its next decode-step
//! boundary. A row's version is that of its oldest token, and admission waits for weights new
//! enough that this version is within the staleness bound of the group's step.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use asyncflow_core::Claimed;

use crate::costs::CostModel;
use crate::decode::DecodeDevice;
use crate::error::{Result, SimError};
use crate::index::{TimedIndex, spec};
use crate::lengths::group_lengths;
use crate::ranks::RankLoads;
use crate::scenario::{Mode, Outcome, Partial, Scenario};

const PROMPTS: &str = "prompts";
const SAMPLES: &str = "step-";
/// Rows a reward worker takes per claim, as the real reward worker does.
const REWARD_BATCH: usize = 256;

fn step_partition(step: u64) -> String {
    format!("{SAMPLES}{step}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Device(usize),
    RewardDone(usize),
    PoolDone,
}

/// An event at a virtual time; ordered by time, then by scheduling order.
#[derive(Debug, PartialEq)]
struct Timed(f64, u64, Event);

impl Eq for Timed {}

impl PartialOrd for Timed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

/// Work holding the training pool.
#[derive(Debug)]
enum PoolJob {
    /// Colocated: moving the pool from generation to training.
    Switch,
    Reference(Claimed),
    Train(Claimed),
    Optimizer,
    Publish,
}

impl PoolJob {
    fn role(&self) -> &'static str {
        match self {
            PoolJob::Switch => "switch",
            PoolJob::Reference(_) => "reference",
            PoolJob::Train(_) | PoolJob::Optimizer => "trainer",
            PoolJob::Publish => "publish",
        }
    }
}

/// One rollout call in flight: prompt groups claimed by one worker of one device.
#[derive(Debug)]
struct Call {
    device: usize,
    prompts: Claimed,
    target: u64,
    version: u64,
    /// Response lengths of each group.
    groups: Vec<(u64, Vec<u64>)>,
    /// Version of each response's oldest token, in the order of `groups` (partial rollout).
    versions: Vec<u64>,
    left: usize,
}

/// Why a rollout worker did not start a call.
enum NoCall {
    NoPrompts,
    /// The oldest prompts need newer weights than any published.
    NeedsWeights,
}

/// Which roles may find new work: a role looks at the index only when an event could have given
/// it some, so that idle roles do not rescan the index after every event.
// One flag per role reads better than a bit set.
#[allow(clippy::struct_excessive_bools)]
#[derive(Debug, Clone, Copy)]
struct Dirty {
    rollout: bool,
    reward: bool,
    advantage: bool,
    pool: bool,
}

impl Dirty {
    const ALL: Self = Self { rollout: true, reward: true, advantage: true, pool: true };
}

/// Busy spans `(role, from, to, devices)`, clipped to the measured window at the end.
#[derive(Default)]
struct Spans(Vec<(&'static str, f64, f64, usize)>);

impl Spans {
    fn device_seconds(&self, role: &str, window: (f64, f64)) -> f64 {
        self.0
            .iter()
            .filter(|s| s.0 == role)
            .map(|&(_, from, to, n)| (to.min(window.1) - from.max(window.0)).max(0.0) * n as f64)
            .fold(0.0, |a, b| a + b)
    }
}

pub struct Cluster {
    costs: CostModel,
    mode: Mode,
    total_steps: u64,
    warmup_steps: u64,
    rollout_devices: usize,
    train_devices: usize,
    calls_per_device: usize,
    groups_per_call: usize,
    micro_batch_rows: usize,
    rows_per_step: usize,
    index: TimedIndex,
    now: f64,
    scheduled: u64,
    events: BinaryHeap<Reverse<Timed>>,
    event_count: u64,
    devices: Vec<DecodeDevice>,
    /// When each device's pending event is due (older heap entries are stale).
    device_due: Vec<Option<f64>>,
    calls: Vec<Option<Call>>,
    calls_on: Vec<usize>,
    calls_in_flight: usize,
    dirty: Dirty,
    /// The oldest prompts wait for weights newer than those published.
    rollout_blocked: bool,
    reward_batches: Vec<Option<Claimed>>,
    pool_job: Option<PoolJob>,
    /// Colocated: whether the pool is laid out for training.
    pool_on_train_side: bool,
    /// Token count (prompt + response) of each sample row, by row index.
    tokens: Vec<u64>,
    issued_steps: u64,
    trained_steps: u64,
    step_rows: usize,
    whole_step_ready: bool,
    train_ranks: RankLoads,
    reference_ranks: RankLoads,
    /// Sum and count of the trained samples' policy ages.
    ages: (f64, f64),
    max_age: u64,
    spans: Spans,
    window_start: f64,
}

impl Cluster {
    pub fn new(scenario: &Scenario) -> Result<Self> {
        let costs = scenario.costs.clone();
        let mode = scenario.mode;
        if mode.partial != Partial::Off && (mode.colocated || !mode.streaming) {
            return Err(SimError::Invalid("partial rollout needs an async-<k> mode".into()));
        }
        if scenario.steps == 0 || scenario.warmup_steps == 0 {
            return Err(SimError::Invalid("warm-up and measured steps must be at least 1".into()));
        }
        let (rollout_devices, train_devices) =
            if mode.colocated { (costs.devices, costs.devices) } else { costs.split() };
        let groups_per_step = costs.workload.prompts_per_step as usize;
        // As in the emulation: the synchronous modes split each step evenly, one call per device.
        let (calls_per_device, groups_per_call) = if mode.streaming {
            (costs.calls_per_device, costs.groups_per_call as usize)
        } else {
            (1, groups_per_step.div_ceil(rollout_devices))
        };
        let n = costs.workload.group_size as usize;
        Ok(Self {
            mode,
            total_steps: scenario.warmup_steps + scenario.steps,
            warmup_steps: scenario.warmup_steps,
            rollout_devices,
            train_devices,
            calls_per_device,
            groups_per_call,
            micro_batch_rows: costs.micro_batch_groups as usize * n,
            rows_per_step: groups_per_step * n,
            index: TimedIndex::new(PROMPTS, SAMPLES)?,
            now: 0.0,
            scheduled: 0,
            events: BinaryHeap::new(),
            event_count: 0,
            devices: (0..rollout_devices)
                .map(|_| DecodeDevice::new(costs.rollout.clone()))
                .collect(),
            device_due: vec![None; rollout_devices],
            calls: Vec::new(),
            calls_on: vec![0; rollout_devices],
            calls_in_flight: 0,
            dirty: Dirty::ALL,
            rollout_blocked: false,
            reward_batches: (0..costs.reward_workers).map(|_| None).collect(),
            pool_job: None,
            pool_on_train_side: false,
            tokens: Vec::new(),
            issued_steps: 0,
            trained_steps: 0,
            step_rows: 0,
            whole_step_ready: false,
            train_ranks: RankLoads::new(train_devices),
            reference_ranks: RankLoads::new(train_devices),
            ages: (0.0, 0.0),
            max_age: 0,
            spans: Spans::default(),
            window_start: f64::INFINITY,
            costs,
        })
    }

    fn schedule(&mut self, at: f64, event: Event) {
        self.scheduled += 1;
        self.events.push(Reverse(Timed(at, self.scheduled, event)));
    }

    /// Runs until the last step is trained.
    pub fn run(mut self) -> Result<Outcome> {
        self.pump()?;
        while self.trained_steps < self.total_steps {
            let Some(Reverse(Timed(at, _, event))) = self.events.pop() else {
                return Err(SimError::Stalled {
                    time: self.now,
                    reason: format!("nothing left to happen after {} steps", self.trained_steps),
                });
            };
            self.now = at;
            self.event_count += 1;
            match event {
                Event::Device(d) if self.device_due[d] == Some(at) => self.device_event(d)?,
                Event::Device(_) => continue, // superseded by a later schedule
                Event::RewardDone(w) => self.reward_done(w)?,
                Event::PoolDone => self.pool_done()?,
            }
            self.pump()?;
        }
        Ok(self.outcome())
    }

    /// Lets every idle role take what work it can, until none can.
    fn pump(&mut self) -> Result<()> {
        loop {
            let mut progressed = self.feed()?;
            if self.dirty.rollout {
                progressed |= self.start_rollouts()?;
            }
            if self.dirty.reward {
                progressed |= self.start_rewards()?;
            }
            if self.dirty.advantage {
                progressed |= self.advantages()?;
            }
            if self.dirty.pool {
                progressed |= self.start_pool_job()?;
            }
            if !progressed {
                return Ok(());
            }
        }
    }

    // ---- feeder -------------------------------------------------------------------------------

    /// Prompts of a step go out once the trainer is at most `staleness + 1` steps behind it.
    fn feed(&mut self) -> Result<bool> {
        let ahead = self.trained_steps + self.mode.staleness + 1;
        let mut fed = false;
        while self.issued_steps < self.total_steps && self.issued_steps <= ahead {
            let g = self.costs.workload.prompts_per_step;
            let groups: Vec<u64> = (self.issued_steps * g..(self.issued_steps + 1) * g).collect();
            self.index.put_new("prompt", PROMPTS.to_owned(), groups, 1, vec![0])?;
            self.issued_steps += 1;
            self.dirty.rollout = true;
            fed = true;
        }
        Ok(fed)
    }

    // ---- rollout ------------------------------------------------------------------------------

    fn start_rollouts(&mut self) -> Result<bool> {
        if self.rollout_blocked || (self.mode.colocated && self.pool_job.is_some()) {
            return Ok(false);
        }
        if self.mode.partial != Partial::Off {
            return self.admit_groups();
        }
        let mut started = false;
        for d in 0..self.rollout_devices {
            // A worker claims prompts only while its device has no sequence waiting for a slot,
            // as the real rollout worker asks its engine for room first.
            while self.calls_on[d] < self.calls_per_device && self.devices[d].queued() == 0 {
                match self.start_call(d, self.groups_per_call)? {
                    Ok(()) => started = true,
                    Err(why) => {
                        self.rollout_blocked = matches!(why, NoCall::NeedsWeights);
                        self.dirty.rollout = false;
                        return Ok(started);
                    }
                }
            }
        }
        self.dirty.rollout = false;
        Ok(started)
    }

    /// Partial rollout: each device's worker admits prompt groups while their sequences fit
    /// under its limit (one group at least when the device is idle). The devices take turns, a
    /// claim each, as their workers claim between decode steps side by side.
    fn admit_groups(&mut self) -> Result<bool> {
        let n = self.costs.workload.group_size as usize;
        let limit = self.calls_per_device * self.groups_per_call * n;
        let mut started = false;
        loop {
            let mut any = false;
            for d in 0..self.rollout_devices {
                let in_flight = self.devices[d].in_flight();
                let room = limit.saturating_sub(in_flight);
                if in_flight > 0 && room < n {
                    continue;
                }
                let groups = (room / n).clamp(1, self.groups_per_call);
                match self.start_call(d, groups)? {
                    Ok(()) => any = true,
                    Err(why) => {
                        self.rollout_blocked = matches!(why, NoCall::NeedsWeights);
                        self.dirty.rollout = false;
                        return Ok(started || any);
                    }
                }
            }
            started |= any;
            if !any {
                self.dirty.rollout = false;
                return Ok(started);
            }
        }
    }

    /// A rollout worker of device `d` claims up to `groups` prompt groups of one target step,
    /// loads the newest weights if it lacks them (under partial rollout the device loads each
    /// version as it is published instead), and submits the groups' responses to the device: as
    /// one call, or under partial rollout as one call per group.
    fn start_call(&mut self, d: usize, groups: usize) -> Result<std::result::Result<(), NoCall>> {
        let claim = spec("rollout", &["prompt"], groups, Some(PROMPTS.into()), false);
        let Some(prompts) = self.index.claim(self.now, &claim, true)? else {
            return Ok(Err(NoCall::NoPrompts));
        };
        let per_step = self.costs.workload.prompts_per_step;
        let target_of = |g: &Option<u64>| g.expect("prompt rows have groups") / per_step;
        let target = prompts.groups.iter().map(target_of).min().expect("a non-empty claim");
        let later: Vec<u64> = prompts
            .rows
            .iter()
            .zip(&prompts.groups)
            .filter(|(_, g)| target_of(g) > target)
            .map(|(&r, _)| r)
            .collect();
        if !later.is_empty() {
            self.index.release(self.now, &prompts, Some(&later))?;
        }
        let published = self.trained_steps;
        self.settle_device(d)?;
        let partial = self.mode.partial != Partial::Off;
        if !partial && self.devices[d].version < published {
            let load = if self.mode.colocated { 0.0 } else { self.costs.rollout.weight_load_s };
            self.devices[d].load(published, load);
        }
        // The version that samples the first token of what is submitted now: under partial
        // rollout, that of a load waiting for the decode step in progress to end.
        if self.devices[d].next_version() + self.mode.staleness < target {
            let kept: Vec<u64> =
                prompts.rows.iter().copied().filter(|r| !later.contains(r)).collect();
            self.index.release(self.now, &prompts, Some(&kept))?;
            self.reschedule(d);
            return Ok(Err(NoCall::NeedsWeights));
        }
        let w = &self.costs.workload;
        let groups: Vec<(u64, Vec<u64>)> = prompts
            .groups
            .iter()
            .filter(|g| target_of(g) == target)
            .map(|g| {
                let g = g.expect("prompt rows have groups");
                let (median, sigma, cap) =
                    (w.response_median_tokens, w.response_sigma, w.response_max_tokens);
                (g, group_lengths(w.seed, g, w.group_size, median, sigma, cap))
            })
            .collect();
        let prompt_tokens = w.prompt_tokens;
        if partial {
            // One call per group, each put and acked on its own, as the partial worker splits
            // its claims; the claim's lease is shared, so each group acks its own row.
            let rows =
                prompts.rows.iter().zip(&prompts.groups).filter(|(_, g)| target_of(g) == target);
            let rows: Vec<u64> = rows.map(|(&r, _)| r).collect();
            for (group, row) in groups.into_iter().zip(rows) {
                let one = Claimed { rows: vec![row], ..prompts.clone() };
                self.submit_call(d, one, target, vec![group], prompt_tokens);
            }
        } else {
            self.submit_call(d, prompts, target, groups, prompt_tokens);
        }
        self.reschedule(d);
        Ok(Ok(()))
    }

    fn submit_call(
        &mut self,
        d: usize,
        prompts: Claimed,
        target: u64,
        groups: Vec<(u64, Vec<u64>)>,
        prompt_tokens: u64,
    ) {
        let lengths: Vec<u64> = groups.iter().flat_map(|(_, l)| l.iter().copied()).collect();
        let id = self.calls.len();
        self.devices[d].submit(self.now, &lengths, prompt_tokens, id);
        let version = self.devices[d].next_version();
        self.calls.push(Some(Call {
            device: d,
            prompts,
            target,
            version,
            versions: vec![version; lengths.len()],
            groups,
            left: lengths.len(),
        }));
        self.calls_on[d] += 1;
        self.calls_in_flight += 1;
    }

    fn reschedule(&mut self, d: usize) {
        let due = self.devices[d].next_event();
        self.device_due[d] = due;
        if let Some(at) = due {
            self.schedule(at, Event::Device(d));
        }
    }

    /// Runs device `d` up to now and finishes the calls whose last sequence is done.
    fn settle_device(&mut self, d: usize) -> Result<()> {
        for done in self.devices[d].advance(self.now) {
            let call = self.calls[done.call].as_mut().expect("a call in flight");
            call.versions[done.slot] = done.version;
            call.left -= 1;
            if call.left == 0 {
                let call = self.calls[done.call].take().expect("a call in flight");
                self.finish_call(&call)?;
            }
        }
        Ok(())
    }

    fn device_event(&mut self, d: usize) -> Result<()> {
        self.device_due[d] = None;
        let version = self.devices[d].version;
        self.settle_device(d)?;
        if self.devices[d].version != version {
            self.dirty.rollout = true; // a load at a step boundary: queued groups may start
        }
        self.reschedule(d);
        Ok(())
    }

    /// Puts a finished call's responses into its step's partition and acks its prompts.
    fn finish_call(&mut self, call: &Call) -> Result<()> {
        let n = self.costs.workload.group_size;
        let rows_of = |(g, l): &(u64, Vec<u64>)| std::iter::repeat_n(*g, l.len());
        let groups: Vec<u64> = call.groups.iter().flat_map(rows_of).collect();
        let partition = step_partition(call.target);
        // Off: every token was sampled by the call's version (the version it began with).
        // Partial: each row carries its oldest token's version, as the real rows do.
        let versions = if self.mode.partial == Partial::Off {
            vec![call.version]
        } else {
            call.versions.clone()
        };
        let rows = self.index.put_new("response", partition, groups, n as u32, versions)?;
        let prompt = self.costs.workload.prompt_tokens;
        let responses = call.groups.iter().flat_map(|(_, l)| l.iter());
        for (&row, &response) in rows.iter().zip(responses) {
            let slot = row as usize;
            if self.tokens.len() <= slot {
                self.tokens.resize(slot + 1, 0);
            }
            self.tokens[slot] = prompt + response;
        }
        if self.mode.partial == Partial::Off {
            self.index.ack(self.now, &call.prompts)?;
        } else {
            self.index.ack_rows(self.now, &call.prompts)?; // its group's row of a shared claim
        }
        self.calls_on[call.device] -= 1;
        self.calls_in_flight -= 1;
        self.dirty = Dirty { advantage: self.dirty.advantage, ..Dirty::ALL };
        Ok(())
    }

    // ---- reward and advantage -----------------------------------------------------------------

    fn start_rewards(&mut self) -> Result<bool> {
        let mut started = false;
        for w in 0..self.reward_batches.len() {
            if self.reward_batches[w].is_some() {
                continue;
            }
            let claim = spec("reward", &["response"], REWARD_BATCH, None, false);
            let Some(batch) = self.index.claim(self.now, &claim, true)? else {
                self.dirty.reward = false;
                return Ok(started);
            };
            let done = self.now + batch.rows.len() as f64 * self.costs.reward_per_sample_s;
            self.spans.0.push(("reward", self.now, done, 1));
            self.reward_batches[w] = Some(batch);
            self.schedule(done, Event::RewardDone(w));
            started = true;
        }
        self.dirty.reward = false; // every worker is busy: a finished one marks it again
        Ok(started)
    }

    fn reward_done(&mut self, w: usize) -> Result<()> {
        let batch = self.reward_batches[w].take().expect("a reward worker at work");
        self.index.fill(&batch.rows, "reward")?;
        self.dirty.reward = true;
        self.dirty.advantage = true;
        self.index.ack(self.now, &batch)
    }

    /// Group advantages take no modelled time.
    fn advantages(&mut self) -> Result<bool> {
        let mut any = false;
        let claim = spec("advantage", &["reward"], self.rows_per_step, None, true);
        while let Some(batch) = self.index.claim(self.now, &claim, true)? {
            self.index.fill(&batch.rows, "advantage")?;
            self.index.ack(self.now, &batch)?;
            self.dirty.pool = true;
            any = true;
        }
        self.dirty.advantage = false;
        Ok(any)
    }

    // ---- the training pool --------------------------------------------------------------------

    fn start_pool_job(&mut self) -> Result<bool> {
        // Colocated, the pool turns to training only once generation has drained (weights load
        // instantly there, so calls in flight are all the generation work there is).
        if self.pool_job.is_some() || (self.mode.colocated && self.calls_in_flight > 0) {
            self.dirty.pool = false;
            return Ok(false);
        }
        let Some(job) = self.next_pool_job()? else {
            self.dirty.pool = false;
            return Ok(false);
        };
        if self.mode.colocated && !self.pool_on_train_side {
            // The pool moves first; the claimed work goes back to the index meanwhile.
            if let PoolJob::Reference(c) | PoolJob::Train(c) = &job {
                self.index.release(self.now, c, None)?;
            }
            self.pool_on_train_side = true;
            self.run_pool_job(PoolJob::Switch);
            return Ok(true);
        }
        self.run_pool_job(job);
        Ok(true)
    }

    /// Reference first (training needs its output), then the optimizer step once the step's
    /// samples are trained, else the trainer's next micro-batch.
    fn next_pool_job(&mut self) -> Result<Option<PoolJob>> {
        let claim = spec("reference", &["response"], self.micro_batch_rows, None, false);
        if let Some(batch) = self.index.claim(self.now, &claim, true)? {
            return Ok(Some(PoolJob::Reference(batch)));
        }
        if self.step_rows == self.rows_per_step {
            return Ok(Some(PoolJob::Optimizer));
        }
        let fields = ["advantage", "ref"];
        let partition = Some(step_partition(self.trained_steps));
        if !self.mode.streaming && !self.whole_step_ready {
            let whole = spec("train", &fields, self.rows_per_step, partition.clone(), true);
            let Some(batch) = self.index.claim(self.now, &whole, false)? else {
                return Ok(None);
            };
            self.index.release(self.now, &batch, None)?;
            self.whole_step_ready = true;
        }
        let want = self.micro_batch_rows.min(self.rows_per_step - self.step_rows);
        let claim = spec("train", &fields, want, partition, true);
        Ok(self.index.claim(self.now, &claim, true)?.map(PoolJob::Train))
    }

    fn run_pool_job(&mut self, job: PoolJob) {
        let tokens =
            |c: &Claimed, t: &[u64]| c.rows.iter().map(|&r| t[r as usize]).collect::<Vec<_>>();
        let seconds = match &job {
            PoolJob::Switch => self.costs.to_train_s,
            PoolJob::Reference(c) => {
                self.reference_ranks.add(&tokens(c, &self.tokens))
                    / self.costs.reference_tokens_per_s
            }
            PoolJob::Train(c) => {
                self.train_ranks.add(&tokens(c, &self.tokens)) / self.costs.trainer_tokens_per_s
            }
            PoolJob::Optimizer => {
                self.costs.optimizer_step_s + self.costs.network.all_reduce_s(self.train_devices)
            }
            PoolJob::Publish => self.costs.network.publish_s(self.rollout_devices),
        };
        let done = self.now + seconds;
        self.spans.0.push((job.role(), self.now, done, self.train_devices));
        self.pool_job = Some(job);
        self.schedule(done, Event::PoolDone);
    }

    fn pool_done(&mut self) -> Result<()> {
        self.dirty.pool = true;
        match self.pool_job.take().expect("a pool job in flight") {
            PoolJob::Switch => {}
            PoolJob::Reference(batch) => {
                self.index.fill(&batch.rows, "ref")?;
                self.index.ack(self.now, &batch)?;
            }
            PoolJob::Train(batch) => {
                let step = self.trained_steps as f64;
                self.ages.0 += batch.versions.iter().map(|&v| step - v as f64).sum::<f64>();
                self.ages.1 += batch.versions.len() as f64;
                let oldest = batch.versions.iter().min().copied().unwrap_or(self.trained_steps);
                self.max_age = self.max_age.max(self.trained_steps.saturating_sub(oldest));
                self.step_rows += batch.rows.len();
                self.index.ack(self.now, &batch)?;
            }
            PoolJob::Optimizer => {
                self.train_ranks.reset();
                if self.mode.colocated {
                    self.step_done()?; // the move back to generation reshards the weights
                } else {
                    self.run_pool_job(PoolJob::Publish);
                }
            }
            PoolJob::Publish => self.step_done()?,
        }
        Ok(())
    }

    /// The step's weights are out: the next step may begin. Under partial rollout every rollout
    /// device loads them at its next decode-step boundary (`weight_load_s`; under abort also the
    /// prefill of each cut sequence's prompt and prefix).
    fn step_done(&mut self) -> Result<()> {
        self.trained_steps += 1;
        if self.mode.partial != Partial::Off {
            let abort = self.mode.partial == Partial::Abort;
            for d in 0..self.rollout_devices {
                self.settle_device(d)?;
                let load = self.costs.rollout.weight_load_s;
                self.devices[d].load_between_steps(self.trained_steps, load, abort);
                self.reschedule(d);
            }
        }
        self.step_rows = 0;
        self.whole_step_ready = false;
        self.rollout_blocked = false;
        self.dirty = Dirty::ALL;
        if self.trained_steps == self.warmup_steps {
            self.window_start = self.now;
            for d in &mut self.devices {
                d.measure(self.now, f64::INFINITY);
            }
        }
        if self.mode.colocated {
            // Moving back to generation: offload the optimizer states, reshard the weights.
            self.pool_on_train_side = false;
            let until = self.now + self.costs.to_generate_s;
            self.spans.0.push(("switch", self.now, until, self.train_devices));
            for d in &mut self.devices {
                d.hold(until);
            }
        }
        Ok(())
    }

    // ---- results ------------------------------------------------------------------------------

    fn outcome(mut self) -> Outcome {
        let (start, end) = (self.window_start, self.now);
        for d in &mut self.devices {
            d.measure(start, end);
            d.advance(end);
        }
        let span = end - start;
        let steps = self.total_steps - self.warmup_steps;
        let samples = (steps as usize * self.rows_per_step) as f64;
        let (busy, loading, filled) = self.devices.iter().fold((0.0, 0.0, 0.0), |acc, d| {
            (acc.0 + d.time.busy, acc.1 + d.time.loading, acc.2 + d.time.filled)
        });
        let rollout = self.rollout_devices as f64 * span;
        let train = self.train_devices as f64 * span;
        let window = (start, end);
        let pool = |role| self.spans.device_seconds(role, window) / train;
        let reward =
            self.spans.device_seconds("reward", window) / (self.costs.reward_workers as f64 * span);
        Outcome {
            samples_per_s: samples / span,
            ideal_samples_per_s: if self.mode.colocated {
                self.costs.colocated_bound()
            } else {
                self.costs.separated_bound(self.rollout_devices)
            },
            step_time_s: span / steps as f64,
            busy: vec![
                ("rollout", busy / rollout),
                ("weight_load", loading / rollout),
                ("reference", pool("reference")),
                ("trainer", pool("trainer")),
                ("publish", pool("publish")),
                ("switch", pool("switch")),
                ("reward", reward),
            ],
            decode_fill: if busy > 0.0 { filled / busy } else { 0.0 },
            staleness: if self.ages.1 > 0.0 { self.ages.0 / self.ages.1 } else { 0.0 },
            max_staleness: self.max_age,
            rollout_devices: self.rollout_devices,
            train_devices: self.train_devices,
            trained_samples: self.total_steps * self.rows_per_step as u64,
            index_calls: self.index.calls,
            index_seconds: self.index.seconds,
            events: self.event_count,
        }
    }
}
