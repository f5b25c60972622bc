//! Streams and events (`torch.tpu.Stream`, `torch.tpu.Event`) over the workers of
//! `worker::Streams`.
//!
//! In Strict mode a stream is a worker thread with its queue: ops issued on different
//! streams run concurrently, each stream in issue order. An event is a marker job: it is
//! reached once the work queued before it on its stream has finished, and records that
//! time (`elapsed_time` is device time, not dispatch time). Waiting for an event on a
//! stream queues a job there that waits for the marker. Debug mode runs ops on the calling
//! thread, so markers are reached as soon as they are recorded. DeferAndFuse records every
//! stream's ops into the device's one pending graph; recording an event is a flush point
//! (the graph runs, then the marker is queued), so events time and order real work.

use std::sync::Arc;

use crate::worker::{Job, Mark, Streams, Work};
use crate::{Error, Result};

/// A recorded event: the marker job's number (tagged with its stream) and its time.
#[derive(Clone)]
pub struct Event {
    pub seq: u64,
    pub stream: usize,
    mark: Arc<Mark>,
}

fn job(op: &str, work: Work) -> Job {
    Job {
        op: op.to_string(),
        work,
        inputs: Vec::new(),
        outputs: Vec::new(),
        new_outputs: 0,
        deps: Vec::new(),
        padded: Vec::new(),
    }
}

/// A side stream for a new `torch.tpu.Stream`.
pub fn new_stream() -> Result<usize> {
    Ok(crate::get()?.worker.new_side())
}

pub fn set_current(stream: usize) {
    Streams::set_current(stream);
}

pub fn current() -> usize {
    Streams::current_index()
}

/// Whether all work queued on `stream` has finished.
pub fn query(stream: usize) -> Result<bool> {
    let rt = crate::get()?;
    let pending = (0..rt.num_devices()).any(|d| rt.defer.pending_ops(d) > 0);
    Ok(!pending && rt.worker.get(stream).idle())
}

/// Waits for the work queued on `stream` (DeferAndFuse: runs the pending graphs first).
pub fn synchronize(stream: usize) -> Result<()> {
    let rt = crate::get()?;
    rt.flush_all("stream synchronize")?;
    rt.worker.get(stream).drain();
    rt.worker.take_error()
}

/// Records an event on `stream`: reached when the work queued there so far has finished.
pub fn record(stream: usize) -> Result<Event> {
    crate::get()?.flush_all("event record")?;
    marker(stream)
}

/// A marker queued on `stream` without flushing DeferAndFuse's graph (the profiler's
/// per-op markers: a flush per op would change what is measured).
pub fn marker(stream: usize) -> Result<Event> {
    let rt = crate::get()?;
    let mark = Arc::new(Mark::default());
    let m = mark.clone();
    let seq = rt
        .worker
        .get(stream)
        .submit(|_| job("event", Work::Mark(m)))?;
    Ok(Event { seq, stream, mark })
}

impl Event {
    pub fn query(&self) -> bool {
        self.mark.reached().is_some()
    }

    pub fn synchronize(&self) -> Result<()> {
        crate::get()?.worker.wait_for(self.seq);
        Ok(())
    }

    /// Work queued on `stream` from now on waits for this event.
    pub fn block(&self, stream: usize) -> Result<()> {
        let rt = crate::get()?;
        if stream == self.stream || rt.worker.reached(self.seq) {
            return Ok(()); // a stream runs in order; a reached event blocks nothing
        }
        let seq = self.seq;
        rt.worker
            .get(stream)
            .submit(|_| job("event wait", Work::Wait(seq)))?;
        Ok(())
    }

    /// Milliseconds from `self` to `end`, once both are reached.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        self.synchronize()?;
        end.synchronize()?;
        match (self.mark.reached(), end.mark.reached()) {
            (Some(a), Some(b)) => Ok((b as f64 - a as f64) / 1e6),
            _ => Err(Error::runtime(
                "elapsed_time: both events must be recorded before measuring the time between them",
            )),
        }
    }
}
