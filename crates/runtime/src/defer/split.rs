//! Split flushes: a host read runs only what it needs and queues the rest.
//!
//! A training step read with `loss.item()` records forward, backward and optimizer update
//! in one graph, but the read needs only the forward. The flush then runs the read value's
//! ancestors ("the read part") now and queues the rest of the graph on the Strict worker
//! as one program, so that Python records the next step while the device computes the
//! update, as it would in Strict mode. The next graph reads the queued part's results as
//! `GraphIn::Later` inputs. Both parts are cached by their `@main` text like whole graphs.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use stablehlo::{DType, Value};

use super::{discard_flushed, Graph, OpRec};
use crate::storage::Storage;
use crate::worker::{JobIn, Work};
use crate::{Error, ErrorKind, Result, Runtime};

/// Below this many ops outside the read's ancestors, the whole graph runs at once: queuing
/// a second program would cost more than it overlaps.
const MIN_QUEUED_OPS: usize = 16;

type Entry = (usize, Value, DType, Arc<Storage>);

/// The op that created value `v` (ops own the value ids from their `first`).
fn def_op(recs: &[OpRec], v: Value) -> Option<usize> {
    recs.partition_point(|r| r.first <= v.id()).checked_sub(1)
}

/// For each recorded op, whether the read of storage `key` needs it; None when the graph
/// should run whole.
pub(super) fn plan(graph: &Graph, entries: &[Entry], key: usize) -> Option<Vec<bool>> {
    let recs = &graph.recs;
    if recs.len() != graph.ops {
        return None; // recorded while ops were not tracked (a capture)
    }
    let target = entries.iter().find(|e| e.0 == key)?.1;
    let mut needed = vec![false; recs.len()];
    let mut stack = vec![def_op(recs, target)?];
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut needed[i], true) {
            continue;
        }
        stack.extend(recs[i].deps.iter().filter_map(|d| def_op(recs, *d)));
    }
    let rest = needed.iter().filter(|n| !**n).count();
    (rest >= MIN_QUEUED_OPS).then_some(needed)
}

/// One part of a split graph: its `@main` and how its inputs and outputs map back.
struct Part {
    body: String,
    funcs: Vec<bool>,
    /// Graph parameters it reads.
    params: HashSet<Value>,
    /// Entries (indices) whose final value it computes.
    entries: Vec<usize>,
    checks: Vec<usize>,
}

impl Part {
    fn new(nfuncs: usize) -> Part {
        Part {
            body: String::new(),
            funcs: vec![false; nfuncs],
            params: HashSet::new(),
            entries: Vec::new(),
            checks: Vec::new(),
        }
    }

    /// Its parameters among the graph's, in the graph's order: (value, graph input index).
    fn graph_params(&self, graph: &Graph) -> Vec<(Value, usize)> {
        graph
            .b
            .params()
            .iter()
            .enumerate()
            .filter(|(_, p)| self.params.contains(p))
            .map(|(i, p)| (*p, i))
            .collect()
    }

    /// The program of this part: from the cache by its `@main` text, or compiled.
    fn program(
        &self,
        rt: &Runtime,
        device: usize,
        graph: &Graph,
        params: &[Value],
        aliases: &[(Value, usize)],
        outs: &[Value],
    ) -> Result<Arc<pjrt::Executable>> {
        let main = graph.b.finish_part(params, &self.body, aliases, outs, &[]);
        rt.program(device, main, graph.ops, false, || {
            let mut seen = std::collections::HashSet::new();
            let funcs: Vec<&str> = graph
                .funcs
                .iter()
                .zip(&self.funcs)
                .filter(|(f, used)| **used && seen.insert(f.name.as_str()))
                .map(|(f, _)| f.text.as_str())
                .collect();
            graph
                .b
                .finish_part(params, &self.body, aliases, outs, &funcs)
        })
    }
}

impl Part {
    /// The program of only this part's checks, to run first when the part may donate
    /// buffers (so that a failed check leaves them intact); None without checks.
    fn precheck(
        &self,
        rt: &Runtime,
        device: usize,
        graph: &Graph,
        params: &[Value],
        donates: bool,
    ) -> Result<Option<Arc<pjrt::Executable>>> {
        if self.checks.is_empty() || !donates {
            return Ok(None);
        }
        let outs: Vec<Value> = self.checks.iter().map(|c| graph.checks[*c].0).collect();
        self.program(rt, device, graph, params, &[], &outs)
            .map(Some)
    }
}

impl Runtime {
    /// Runs the ops marked in `needed` now and queues the others (see the module doc).
    pub(super) fn flush_split(
        &self,
        device: usize,
        reason: &str,
        mut graph: Graph,
        inputs: Vec<Arc<pjrt::Buffer>>,
        entries: Vec<Entry>,
        needed: &[bool],
    ) -> Result<()> {
        let recs = &graph.recs;
        let in_now = |v: Value| def_op(recs, v).is_none_or(|i| needed[i]);
        let body = graph.b.body();
        let (mut now, mut later) = (Part::new(graph.funcs.len()), Part::new(graph.funcs.len()));
        // Values computed now that the queued part reads: extra outputs of the first.
        let mut crossing = BTreeSet::new();
        for (i, r) in recs.iter().enumerate() {
            let part = if needed[i] { &mut now } else { &mut later };
            part.body.push_str(&body[r.text.0..r.text.1]);
            part.funcs[r.func] = true;
            for f in &r.callees {
                part.funcs[*f] = true;
            }
            part.params.extend(r.params.iter().copied());
            if !needed[i] {
                crossing.extend(r.deps.iter().copied().filter(|d| in_now(*d)));
            }
        }
        for (j, e) in entries.iter().enumerate() {
            if in_now(e.1) {
                now.entries.push(j);
            } else {
                later.entries.push(j);
            }
        }
        // New tensors first: the worker's check failure poisons those and keeps the others.
        later.entries.sort_by_key(|j| entries[*j].3.is_written());
        for (c, check) in graph.checks.iter().enumerate() {
            if in_now(check.0) {
                now.checks.push(c);
            } else {
                later.checks.push(c);
            }
        }
        // The parameter a storage was read from, when an entry rewrites it with the same type.
        let param_of = |j: usize| {
            let (key, v, dt, _) = &entries[j];
            graph
                .params
                .get(key)
                .filter(|(p, pdt, _)| pdt == dt && graph.b.ty(*p) == graph.b.ty(*v))
                .map(|e| e.0)
        };

        // The part run now: its entries, the values the queued part reads, its checks.
        let now_params = now.graph_params(&graph);
        let mut now_outs: Vec<Value> = now.entries.iter().map(|j| entries[*j].1).collect();
        for v in &crossing {
            if !now_outs.contains(v) {
                now_outs.push(*v);
            }
        }
        let n_values = now_outs.len();
        now_outs.extend(now.checks.iter().map(|c| graph.checks[*c].0));
        // Donate only what the queued part does not read.
        let mut now_aliases = Vec::new();
        for (o, j) in now.entries.iter().enumerate() {
            if let Some(p) = param_of(*j).filter(|p| !later.params.contains(p)) {
                if let Some(pi) = now_params.iter().position(|q| q.0 == p) {
                    now_aliases.push((p, o, pi, *j));
                }
            }
        }
        let plain: Vec<Value> = now_params.iter().map(|p| p.0).collect();
        let alias_list: Vec<(Value, usize)> = now_aliases.iter().map(|a| (a.0, a.1)).collect();
        let exe = now.program(self, device, &graph, &plain, &alias_list, &now_outs)?;
        let now_checks: Vec<(ErrorKind, &str)> = now
            .checks
            .iter()
            .map(|c| (graph.checks[*c].1, graph.checks[*c].2.as_str()))
            .collect();
        let precheck = now.precheck(self, device, &graph, &plain, !now_aliases.is_empty())?;

        // The queued part: its parameters, then the values computed now that it reads.
        let later_params = later.graph_params(&graph);
        let mut later_outs: Vec<Value> = later.entries.iter().map(|j| entries[*j].1).collect();
        later_outs.extend(later.checks.iter().map(|c| graph.checks[*c].0));
        let mut later_aliases = Vec::new();
        for (o, j) in later.entries.iter().enumerate() {
            if let Some(p) = param_of(*j) {
                if let Some(pi) = later_params.iter().position(|q| q.0 == p) {
                    later_aliases.push((p, o, pi));
                }
            }
        }
        let mut later_plain: Vec<Value> = later_params.iter().map(|p| p.0).collect();
        later_plain.extend(crossing.iter().copied());
        let alias_list: Vec<(Value, usize)> = later_aliases.iter().map(|a| (a.0, a.1)).collect();
        // None when the other ops' results are all dead: nothing to queue.
        let later_exe = if later_outs.is_empty() {
            None
        } else {
            Some(later.program(self, device, &graph, &later_plain, &alias_list, &later_outs)?)
        };
        let later_checks: Vec<(ErrorKind, String)> = later
            .checks
            .iter()
            .map(|c| (graph.checks[*c].1, graph.checks[*c].2.clone()))
            .collect();
        let later_precheck = later.precheck(
            self,
            device,
            &graph,
            &later_plain,
            !later_aliases.is_empty(),
        )?;

        // Run the read part, as a whole flush would (counted even if its check fails).
        self.metrics.split_flushes.fetch_add(1, Ordering::Relaxed);
        self.forget_finished();
        let refs: Vec<&pjrt::Buffer> = now_params.iter().map(|p| inputs[p.1].as_ref()).collect();
        let keep: Vec<i64> = now_aliases
            .iter()
            .filter(|a| Arc::strong_count(&inputs[now_params[a.2].1]) > 2)
            .map(|a| a.2 as i64)
            .collect();
        let donated: Vec<usize> = now_aliases
            .iter()
            .filter(|a| !keep.contains(&(a.2 as i64)))
            .map(|a| a.3)
            .collect();
        if let (Some(pre), false) = (precheck, donated.is_empty()) {
            let cbufs: Vec<Arc<pjrt::Buffer>> =
                pre.execute(&refs)?.into_iter().map(Arc::new).collect();
            if let Some((i, e)) = self.first_failed_check(now_checks.iter().copied(), &cbufs)? {
                // Nothing ran: the ops before the failed one still take effect.
                drop(refs);
                let all: Vec<&pjrt::Buffer> = inputs.iter().map(|b| b.as_ref()).collect();
                self.keep_before_failure(device, &mut graph, &all, &entries, now.checks[i], &e);
                return Err(e);
            }
        }
        let mut bufs: Vec<Arc<pjrt::Buffer>> = exe
            .execute_donating(&refs, &keep)?
            .into_iter()
            .map(Arc::new)
            .collect();
        drop(refs);
        self.metrics.executions.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .donated_buffers
            .fetch_add(donated.len() as u64, Ordering::Relaxed);
        self.metrics.flushed(graph.ops, reason);
        self.track("deferred graph", &bufs);
        let check_bufs = bufs.split_off(n_values.min(bufs.len()));
        if let Some((i, e)) = self.first_failed_check(now_checks.iter().copied(), &check_bufs)? {
            // Nothing is queued. Without donation the ops before the failed one take effect
            // (computed again from the graph's inputs); else the graph's values are dropped.
            if donated.is_empty() {
                let all: Vec<&pjrt::Buffer> = inputs.iter().map(|b| b.as_ref()).collect();
                self.keep_before_failure(device, &mut graph, &all, &entries, now.checks[i], &e);
            } else {
                discard_flushed(&entries, &donated, &e);
            }
            return Err(e);
        }
        for (j, buf) in now.entries.iter().zip(&bufs) {
            let (_, _, dt, storage) = &entries[*j];
            storage.set_flushed(buf.clone(), *dt);
        }

        let Some(later_exe) = later_exe else {
            return Ok(());
        };
        // Queue the rest. A storage it rewrites in place is read when the job runs (the
        // queue order makes that its recorded value), so that its buffer can be donated.
        let rewritten: HashMap<Value, (DType, Arc<Storage>)> = later_aliases
            .iter()
            .filter_map(|a| graph.params.values().find(|e| e.0 == a.0))
            .map(|(p, dt, s)| (*p, (*dt, s.clone())))
            .collect();
        let mut job_inputs = Vec::with_capacity(later_plain.len());
        for (p, i) in &later_params {
            job_inputs.push(match rewritten.get(p) {
                Some((dt, s)) => JobIn::Storage(s.clone(), *dt),
                None => JobIn::Buf(inputs[*i].clone()),
            });
        }
        for v in &crossing {
            let o = now_outs
                .iter()
                .position(|x| x == v)
                .ok_or_else(|| Error::runtime("split flush: missing value"))?;
            job_inputs.push(JobIn::Buf(bufs[o].clone()));
        }
        let new_outputs = later
            .entries
            .iter()
            .filter(|j| !entries[**j].3.is_written())
            .count();
        let targets: Vec<(Arc<Storage>, DType)> = later
            .entries
            .iter()
            .map(|j| (entries[*j].3.clone(), entries[*j].2))
            .collect();
        let aliased: Vec<usize> = later_aliases.iter().map(|a| a.2).collect();
        // Nothing but the job may hold the buffers it could donate.
        drop((bufs, inputs, entries, rewritten, graph));
        let work = Work::Graph {
            exe: later_exe,
            aliased,
            checks: later_checks,
            precheck: later_precheck,
        };
        let lazy: Vec<Arc<Storage>> = targets.iter().map(|t| t.0.clone()).collect();
        let worker = crate::get()?.worker.current();
        worker.submit_graph("deferred graph", work, job_inputs, targets, new_outputs)?;
        // Pending now: a read waits for the job instead of flushing.
        for s in lazy {
            s.clear_lazy();
        }
        Ok(())
    }
}
