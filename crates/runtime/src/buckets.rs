//! Programs that serve a range of sizes (Strict and Debug).
//!
//! An op's *signature* is its cache key with every tensor reduced to dtype, rank and
//! storage identity. The first call of a signature compiles the exact program, as always.
//! A size class (the power of two a size rounds up to) of a tensor's dim becomes *dynamic*
//! once the signature has seen two different sizes of it there (17 and 18: a growing
//! cache), like torch.compile's automatic dynamic shapes, and so does a larger class at a
//! dim that has one already (growth); sizes one bucket could not serve together (a static
//! model's layers: 64, 128, 256 channels) and persistent tensors (parameters) are no
//! reason. From then on a call whose exact program is not cached and which has a size of
//! a dynamic class runs a bucketed program instead, with only those sizes padded:
//!
//! - a staged tensor is a parameter of its logical shape with each dynamic dim padded to its
//!   bucket (the next power of two, at least 16), filled on the host from the storage (any
//!   view); its real size is an `i32` parameter and `stablehlo.set_dimension_size` tells XLA.
//!   XLA's dynamic padder then makes every op of the rule exact on the real part (reductions
//!   and contractions ignore the padding, concatenation packs, softmax normalizes over the
//!   real length);
//! - a result leaves as a static buffer of its padded shape (`Padded`), which the next
//!   bucketed program reads where it lies (`read_in` maps a view of the real tensor into
//!   it); other readers get the real elements compacted (`unpadded`).
//!
//! So programs per op grow with the number of buckets (logarithmic in the sizes seen), and
//! a size inside a known bucket compiles nothing. The real output sizes of a new tensor come
//! from lowering the op at its exact shapes (no compilation; cached by exact key).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use stablehlo::DType;

use crate::exec::{Loc, Param, Path, RArg, TensorRef, Variant};
use crate::layout::View;
use crate::{Result, Runtime};

static ENABLED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Off unless `TORCH_TPU_SHAPE_BUCKETS=1` (or `set_enabled(true)`): a static model whose
/// layers call one op at several sizes would run its first steps bucketed (resnet18's first
/// forward: 2x the time, 38 MB staged through the host), see ARCHITECTURE.md.
pub fn enabled() -> bool {
    use std::sync::atomic::Ordering;
    match ENABLED.load(Ordering::Relaxed) {
        2 => {
            let on = std::env::var("TORCH_TPU_SHAPE_BUCKETS").is_ok_and(|v| v == "1");
            ENABLED.store(on as u8, Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

pub fn set_enabled(on: bool) {
    ENABLED.store(on as u8, std::sync::atomic::Ordering::Relaxed);
}

/// Calls at one exact shape after which a bucketed op gets its exact program (compiled in
/// the background, `tiers`): a static loop whose op sizes differ between call sites runs
/// exact programs after a few steps, without staging.
pub(crate) const EXACT_HOT: u32 = 4;

/// Exact shapes a signature may have served and still get exact programs: more means its
/// sizes change over time (training over varying lengths), where an exact program per size
/// is the compile storm buckets avoid, and each one put next to bucketed neighbours makes
/// their values go through the host.
const STATIC_SHAPES: u32 = 4;

/// Calls reading one storage at one position that make it a persistent tensor.
const PERSISTENT: u32 = 4;

/// Consecutive training steps that see one size at a dim before it counts as fixed there.
const STEADY: u32 = 3;

/// Smallest bucket: sizes up to it share one program.
const MIN_BUCKET: i64 = 16;

pub(crate) fn bucket(n: i64) -> i64 {
    (n.max(MIN_BUCKET) as u64).next_power_of_two() as i64
}

/// The power of two a size rounds up to, as a bit index: two sizes of one class are what a
/// bucket would serve with one program (sizes below the smallest bucket keep their own
/// classes here, so that head or batch counts of 2 and 4 stay apart).
fn class(n: i64) -> u8 {
    (n.max(1) as u64).next_power_of_two().trailing_zeros() as u8
}

struct Sig {
    /// How often each tensor position has seen each storage, and the training step
    /// (`Buckets::step`) it was first seen in: one read by many calls is a persistent
    /// tensor (a parameter), never staged: its sizes differ between call sites (layers),
    /// not over time. An activation is read by a few calls only (q, k and v projections:
    /// three); a gradient may be read by more (a residual stream's gradient summed for
    /// four biases) but never past its step, so once steps are counted, persistent also
    /// means read in a later step than the first.
    ids: Vec<HashMap<u64, (u32, u64)>>,
    /// Per tensor position and dim, what its sizes did (from tensors that are not
    /// persistent).
    dims: Vec<Vec<DimHistory>>,
    /// The training step of the signature's latest call, and of its latest call before
    /// that step (a loop may step several optimizers: steps need not be consecutive).
    steps: (u64, u64),
    /// A bucketed program of this signature failed to compile or lost a dynamic size:
    /// exact programs only.
    off: bool,
}

/// The sizes one dim of one tensor position of a signature has taken.
#[derive(Default)]
struct DimHistory {
    /// The distinct sizes seen (the first few).
    seen: Vec<i64>,
    /// The size classes (bit `class(n)`) that are dynamic here: two different sizes of one
    /// class were seen, so a bucket serves sizes that otherwise compile apart. Sizes of
    /// different classes are no reason (a static model's layers: 64, 128, 256 channels or
    /// 16, 8, 4 pixels; 4 query and 2 key/value heads), and neither is a change in layout
    /// alone. Only a size of a dynamic class is padded: one signature serves call sites
    /// whose dims hold a varying length at one site and a fixed head count or head size at
    /// another ([8, T, 4, 32] and [8, 4, T, T] copies), and padding those 4 heads to 16 made
    /// attention's copies 5x slower.
    dynamic: u64,
    /// Sizes seen in consecutive training steps of the signature: size, last step, steps in
    /// a row (a few sizes). A size seen in `STEADY` steps in a row is a call site's fixed
    /// size (a weight gradient's 384 output features) sharing the signature with a varying
    /// one of its class (8 x 48 rows elsewhere): never padded, so the result needs no
    /// compacting for the optimizer. A length drawn at random rarely recurs in consecutive
    /// steps.
    runs: Vec<(i64, u64, u32)>,
}

impl DimHistory {
    /// Notes size `n` (> 1): its class becomes dynamic at a second size of the class, or
    /// at first sight past every size seen where a class is dynamic already (growth: a
    /// longer cache, a longer batch).
    fn note(&mut self, n: i64) {
        let bit = 1u64 << class(n);
        if self.seen.contains(&n) || self.dynamic & bit != 0 {
            return;
        }
        let dy = self.dynamic;
        let grows = dy != 0 && {
            let top = self.seen.iter().map(|m| class(*m)).max().unwrap_or(0);
            class(n) > top.max(63 - dy.leading_zeros() as u8)
        };
        if grows || self.seen.iter().any(|m| class(*m) == class(n)) {
            self.dynamic |= bit;
        } else if self.seen.len() < 16 {
            self.seen.push(n);
        }
    }

    fn varies(&self, n: i64) -> bool {
        n > 1 && self.dynamic & (1 << class(n)) != 0
    }

    /// Counts size `n` in the signature's step `step` (`before`: the signature's step
    /// before this one); returns the steps in a row that saw it, this one included.
    fn in_a_row(&mut self, n: i64, step: u64, before: u64) -> u32 {
        let runs = &mut self.runs;
        let Some(r) = runs.iter_mut().find(|r| r.0 == n) else {
            if runs.len() >= 16 {
                runs.retain(|r| r.1 >= before);
            }
            if runs.len() < 16 {
                runs.push((n, step, 1));
            }
            return 1;
        };
        if r.1 != step {
            r.2 = if r.1 == before { r.2 + 1 } else { 1 };
            r.1 = step;
        }
        r.2
    }
}

/// How one call runs bucketed: for each staged tensor, each dim's bucket (None: static).
#[derive(Clone, Debug, Default)]
pub(crate) struct Staging {
    pub staged: HashMap<Path, Vec<Option<i64>>>,
    pub sig: Vec<u8>,
    /// Staged tensors whose storage the signature sees at every call (a weight, a mask
    /// buffer): the same size each time, so read in place even through a changing view.
    pub stable: std::collections::HashSet<Path>,
}

impl Staging {
    pub fn padded(&self, path: Path, t: &TensorRef) -> Option<Vec<i64>> {
        self.staged.get(&path).map(|dims| {
            dims.iter()
                .zip(&t.view.sizes)
                .map(|(b, s)| b.unwrap_or(*s))
                .collect()
        })
    }
}

/// The real sizes of a call's new tensors, and its returns as the exact program has them
/// (an int a rule knows from the shapes would be the bucket's otherwise).
pub(crate) struct Exact {
    pub sizes: Vec<Vec<i64>>,
    pub rets: Vec<crate::exec::RetShape>,
}

pub(crate) type NewSizes = Arc<Exact>;

#[derive(Default)]
pub struct Buckets {
    sigs: Mutex<HashMap<Vec<u8>, Sig>>,
    /// Exact key -> real sizes of the op's new tensors, how many calls had that key (see
    /// `new_sizes`) and the optimizer step of the last one counted.
    sizes: Mutex<HashMap<Vec<u8>, (NewSizes, u32, u64)>>,
    /// Signature -> the exact shapes it has served (`STATIC_SHAPES`).
    shapes: Mutex<HashMap<Vec<u8>, u32>>,
    /// Optimizer steps ended so far (`Runtime::step_boundary`); 0 outside training.
    step: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a call may run bucketed at all: no random state, host tensors only as scalars,
/// no empty tensor, and whatever it writes is a whole storage (replaced by the result).
fn eligible(op: &str, params: &[Param], var: Variant) -> bool {
    if !lowering::rules::serves_sizes(op) {
        return false;
    }
    let whole = |t: &TensorRef| {
        t.dtype.is_some_and(|d| {
            t.view.offset == 0 && dense(&t.view) && t.view.numel() * d.size() as i64 == t.nbytes
        })
    };
    for (i, p) in params.iter().enumerate() {
        match &p.arg {
            RArg::Generator(_) => return false,
            RArg::Tensor(t) => {
                if t.view.numel() == 0 || matches!(t.loc, Loc::Host(_)) && !t.view.sizes.is_empty()
                {
                    return false;
                }
                let target = p.is_out || (var == Variant::Inplace && i == 0);
                if target && !whole(t) {
                    return false;
                }
                if p.is_write && !target {
                    return false;
                }
            }
            RArg::List(items) => {
                for a in items {
                    if let RArg::Tensor(t) = a {
                        if t.view.numel() == 0 || matches!(t.loc, Loc::Host(_)) || p.is_write {
                            return false;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    true
}

/// Every element once, no gaps, in some order of the dims (PyTorch keeps an input's
/// permuted layout for an op's output).
fn dense(v: &View) -> bool {
    let mut dims: Vec<(i64, i64)> = v
        .sizes
        .iter()
        .zip(&v.strides)
        .filter(|(n, _)| **n > 1)
        .map(|(n, s)| (*s, *n))
        .collect();
    dims.sort_unstable();
    let mut expect = 1;
    for (stride, n) in dims {
        if stride != expect {
            return false;
        }
        expect *= n;
    }
    true
}

impl Buckets {
    /// Notes the shapes of a call whose exact program is not cached and says whether it
    /// runs bucketed (and how).
    pub(crate) fn observe(
        &self,
        op: &str,
        overload: &str,
        device: usize,
        params: &[Param],
        var: Variant,
    ) -> Option<Staging> {
        if !enabled() || !eligible(op, params, var) {
            return None;
        }
        let sig = crate::exec::signature(op, overload, device, params);
        let ts = crate::exec::tensors(params);
        let step = self.step.load(std::sync::atomic::Ordering::Relaxed);
        let mut sigs = lock(&self.sigs);
        let Some(s) = sigs.get_mut(&sig) else {
            if sigs.len() >= 1 << 16 {
                sigs.clear();
            }
            let ids = ts
                .iter()
                .map(|(_, t)| t.storage().map(|s| (s.id, (1, step))).into_iter().collect())
                .collect();
            let dims = ts
                .iter()
                .map(|(_, t)| {
                    (t.view.sizes.iter())
                        .map(|n| DimHistory {
                            seen: vec![*n],
                            ..Default::default()
                        })
                        .collect()
                })
                .collect();
            sigs.insert(
                sig,
                Sig {
                    ids,
                    dims,
                    steps: (step, step),
                    off: false,
                },
            );
            return None;
        };
        if s.off {
            return None;
        }
        let mut persistent = vec![false; ts.len()];
        for (i, (_, t)) in ts.iter().enumerate() {
            if let Some(id) = t.storage().map(|s| s.id) {
                let seen = &mut s.ids[i];
                if seen.len() >= 4096 {
                    seen.retain(|_, n| n.0 >= PERSISTENT);
                }
                let (n, first) = seen.entry(id).or_insert((0, step));
                *n = n.saturating_add(1);
                persistent[i] = *n >= PERSISTENT && (step == 0 || *first < step);
            }
        }
        for (i, (_, t)) in ts.iter().enumerate() {
            if persistent[i] {
                continue;
            }
            for (d, n) in t.view.sizes.iter().enumerate() {
                if *n > 1 {
                    s.dims[i][d].note(*n);
                }
            }
        }
        let mut steady = vec![Vec::new(); ts.len()];
        if step > 0 {
            if s.steps.0 != step {
                s.steps = (step, s.steps.0);
            }
            let before = s.steps.1;
            for (i, (_, t)) in ts.iter().enumerate() {
                steady[i] = (t.view.sizes.iter().enumerate())
                    .map(|(d, n)| s.dims[i][d].in_a_row(*n, step, before) >= STEADY)
                    .collect();
            }
        }
        // Whether size `n` at dim `d` of tensor `i` is of a dynamic class there, and not
        // fixed there in the last steps.
        let varies = |i: usize, d: usize, n: i64| {
            s.dims[i][d].varies(n) && !steady[i].get(d).copied().unwrap_or(false)
        };
        let moving = |i: usize| {
            !persistent[i] && (ts[i].1.view.sizes.iter().enumerate()).any(|(d, n)| varies(i, d, *n))
        };
        if !(0..ts.len()).any(moving) {
            return None;
        }
        let mut staging = Staging {
            staged: HashMap::new(),
            sig,
            stable: Default::default(),
        };
        // Duck sizing, as Dynamo's symbolic shapes: a size that is dynamic in one tensor is
        // padded wherever it appears in the call (a contraction's other operand, a broadcast
        // partner, a parameter), so the padded shapes still agree. Without it a call whose
        // weight never changes but matches a growing dim made the rule fail (1x512 by
        // 344x128) and turned the signature off.
        let sizes: std::collections::HashSet<i64> = ts
            .iter()
            .enumerate()
            .filter(|(i, _)| moving(*i))
            .flat_map(|(i, (_, t))| {
                t.view
                    .sizes
                    .iter()
                    .enumerate()
                    .filter(move |(d, n)| varies(i, *d, **n))
                    .map(|(_, n)| *n)
            })
            .collect();
        for (i, (path, t)) in ts.iter().enumerate() {
            let dims: Vec<Option<i64>> = t
                .view
                .sizes
                .iter()
                .enumerate()
                // A size of 1 broadcasts: never padded (its own program).
                // A static size that only equals a dynamic one is padded when padding
                // changes it (a head size of 20 next to a length of 20), not when it is a
                // bucket's size already (32 and 32 agree unpadded).
                .map(|(d, n)| {
                    let duck = sizes.contains(n) && bucket(*n) != *n;
                    (*n != 1 && (varies(i, d, *n) && moving(i) || duck)).then(|| bucket(*n))
                })
                .collect();
            if dims.iter().any(Option::is_some) {
                staging.staged.insert(*path, dims);
                if persistent[i] {
                    staging.stable.insert(*path);
                }
            }
        }
        // Nothing to pad (the dynamic sizes are 1 here): the exact program.
        (!staging.staged.is_empty()).then_some(staging)
    }

    /// An optimizer step ended (see `Sig::ids`).
    pub(crate) fn step_ended(&self) {
        self.step.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Forgets every signature's sizes, the calls per exact shape and the steps counted
    /// (programs stay cached).
    pub fn forget(&self) {
        lock(&self.sigs).clear();
        lock(&self.sizes).clear();
        lock(&self.shapes).clear();
        self.step.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a call served `calls` times at its exact shape should now get its exact
    /// program: once it is hot, and only while its signature has served few shapes.
    pub(crate) fn exact_is_due(&self, sig: &[u8], calls: u32) -> bool {
        let mut m = lock(&self.shapes);
        if calls == 1 {
            if m.len() >= 1 << 16 {
                m.clear();
            }
            *m.entry(sig.to_vec()).or_default() += 1;
        }
        calls == EXACT_HOT && m.get(sig).is_some_and(|n| *n <= STATIC_SHAPES)
    }

    /// Exact programs only from now on for this signature.
    pub(crate) fn disable(&self, sig: &[u8]) {
        if let Some(s) = lock(&self.sigs).get_mut(sig) {
            s.off = true;
        }
    }

    /// The real sizes of the new tensors of a call, computed once per exact key by lowering
    /// it (no compilation), and how many calls had that key, this one included, or None
    /// when this call did not count. Once an optimizer has stepped, calls in one step count
    /// once: a length used again and again within one training step is no static loop (its
    /// exact program would serve one step and rarely run again). None when the op does not
    /// lower at these shapes.
    pub(crate) fn new_sizes(
        &self,
        key: &[u8],
        f: impl FnOnce() -> Result<Option<Exact>>,
    ) -> Result<Option<(NewSizes, Option<u32>)>> {
        let step = self.step.load(std::sync::atomic::Ordering::Relaxed);
        if let Some((s, n, last)) = lock(&self.sizes).get_mut(key) {
            let counts = step == 0 || *last != step;
            if counts {
                *n = n.saturating_add(1);
                *last = step;
            }
            return Ok(Some((s.clone(), counts.then_some(*n))));
        }
        let Some(v) = f()? else { return Ok(None) };
        let v = Arc::new(v);
        let mut m = lock(&self.sizes);
        if m.len() >= 1 << 16 {
            m.clear();
        }
        m.insert(key.to_vec(), (v.clone(), 1, step));
        Ok(Some((v, Some(1))))
    }
}

/// A staged input: the view's elements laid out in `padded` (row-major), zeros elsewhere.
pub(crate) fn stage(
    rt: &Runtime,
    storage: &pjrt::Buffer,
    dtype: DType,
    view: &View,
    padded: &[i64],
) -> Result<Arc<pjrt::Buffer>> {
    let bytes = rt.download(storage)?;
    rt.metrics
        .bucket_host_bytes
        .fetch_add(bytes.len() as u64, Relaxed);
    let size = dtype.size();
    // SAFETY: `bytes` is the whole storage and the view lies inside it (PyTorch's bounds).
    let real = unsafe { crate::host::read(bytes.as_ptr(), view, size) };
    let n: i64 = padded.iter().product();
    let mut out = vec![0u8; n as usize * size];
    if padded == view.sizes.as_slice() {
        out.copy_from_slice(&real);
    } else {
        let mut strides = vec![1i64; padded.len()];
        for d in (0..padded.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * padded[d + 1];
        }
        let to = View {
            sizes: view.sizes.clone(),
            strides,
            offset: 0,
        };
        // SAFETY: `to` indexes inside `out` (each real size is at most its padded size).
        unsafe { crate::host::write(out.as_mut_ptr(), &to, size, &real) };
    }
    Ok(Arc::new(rt.upload(
        &out,
        dtype,
        padded,
        storage.device(),
    )?))
}

/// A bucketed program's result as its storage holds it: the padded shape the program
/// computed it in (`padded`, a flat buffer of that many elements) and the tensor's real
/// sizes (`real`), each real element at its row-major index in the padded shape. The next
/// bucketed program reads it there; other readers get it compacted (`unpad`).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Padded {
    pub padded: Vec<i64>,
    pub real: Vec<i64>,
}

impl Padded {
    /// An exact buffer of `n` elements.
    pub fn exact(n: i64) -> Padded {
        Padded {
            padded: vec![n],
            real: vec![n],
        }
    }

    pub fn is_exact(&self) -> bool {
        self.padded.iter().product::<i64>() == self.real.iter().product::<i64>()
    }

    /// The real elements as a view of the padded buffer.
    pub fn view(&self) -> View {
        View {
            sizes: self.real.clone(),
            strides: lowering::shape::contiguous_strides(&self.padded),
            offset: 0,
        }
    }
}

/// Where a bucketed program's result goes: its layout, and the target's when that is not
/// row-major (an out= tensor in a permuted layout: laid out on the host).
#[derive(Clone, Debug)]
pub(crate) struct ResultLayout {
    pub layout: Padded,
    pub target: Option<View>,
}

/// The real elements of a padded buffer, row-major, on the host.
fn unpad(rt: &Runtime, buf: &pjrt::Buffer, dtype: DType, p: &Padded) -> Result<Vec<u8>> {
    let mut bytes = rt.download(buf)?;
    rt.metrics
        .bucket_host_bytes
        .fetch_add(bytes.len() as u64, Relaxed);
    if p.is_exact() {
        bytes.truncate(p.real.iter().product::<i64>() as usize * dtype.size());
        return Ok(bytes);
    }
    // SAFETY: the padded view's elements lie inside the buffer (each real size is at most
    // its padded one).
    Ok(unsafe { crate::host::read(bytes.as_ptr(), &p.view(), dtype.size()) })
}

/// The storage of a bucketed program's result as one exact flat buffer, laid out as the
/// target says.
pub(crate) fn compact(
    rt: &Runtime,
    buf: &Arc<pjrt::Buffer>,
    dtype: DType,
    res: &ResultLayout,
) -> Result<Arc<pjrt::Buffer>> {
    let elems: i64 = res.layout.real.iter().product();
    if res.layout.is_exact() && res.target.is_none() {
        return Ok(buf.clone());
    }
    let mut bytes = unpad(rt, buf, dtype, &res.layout)?;
    if let Some(v) = &res.target {
        let mut out = vec![0u8; bytes.len()];
        // SAFETY: `v` is dense over exactly `elems` elements (checked by `eligible`).
        unsafe { crate::host::write(out.as_mut_ptr(), v, dtype.size(), &bytes) };
        bytes = out;
    }
    Ok(Arc::new(rt.upload(
        &bytes,
        dtype,
        &[elems],
        buf.device(),
    )?))
}

/// `torch.arange` of integers into a fresh tensor, computed on the host and uploaded: its
/// program would depend on the bounds' values (positions in generation: one program per
/// token). In DeferAndFuse only with shape buckets on and outside torch.compile captures
/// (the upload is a graph input: one graph structure for every position). Returns false
/// when the call is not one (floats, a written or large output).
pub(crate) fn host_arange(rt: &Runtime, op: &str, params: &[Param]) -> Result<bool> {
    if op != "aten::arange" {
        return Ok(false);
    }
    let int = |name: &str, default: Option<i64>| match params.iter().find(|p| p.name == name) {
        Some(Param {
            arg: RArg::Int(v), ..
        }) => Some(*v),
        None => default,
        Some(_) => None,
    };
    let (Some(start), Some(end), Some(step)) = (
        int("start", Some(0)),
        int("end", None),
        int("step", Some(1)),
    ) else {
        return Ok(false);
    };
    let Some(RArg::Tensor(out)) = params.iter().find(|p| p.is_out).map(|p| &p.arg) else {
        return Ok(false);
    };
    let (Some(dt), Loc::Device(sp)) = (out.dtype, out.loc) else {
        return Ok(false);
    };
    let deferred = crate::mode::get() == crate::mode::EagerMode::DeferAndFuse;
    if deferred && (!enabled() || rt.defer.capturing(out.device)) {
        return Ok(false);
    }
    if step == 0 || !matches!(dt, DType::I64 | DType::I32) {
        return Ok(false);
    }
    let n = (end - start + step - step.signum()) / step;
    // SAFETY: the shim holds the tensor alive during the call.
    let storage = unsafe { &*sp };
    let whole = out.view.is_whole(out.nbytes / dt.size() as i64);
    if n <= 0 || n > 1 << 16 || out.view.sizes != [n] || !whole || storage.is_written() {
        return Ok(false);
    }
    let mut bytes = Vec::with_capacity(n as usize * dt.size());
    for i in 0..n {
        let v = start + i * step;
        match dt {
            DType::I64 => bytes.extend_from_slice(&v.to_le_bytes()),
            _ => bytes.extend_from_slice(&(v as i32).to_le_bytes()),
        }
    }
    let buf = rt.upload(&bytes, dt, &[n], out.device)?;
    storage.set(Arc::new(buf), dt)?;
    rt.metrics.native(op);
    Ok(true)
}

/// A `size` argument equal to a staged tensor's sizes (the destination shape of
/// `torch_pjrt::copy`, which `repeat_interleave` and `expand(...).clone()` reach) becomes
/// that tensor's padded sizes, so that the program is the bucket's.
pub(crate) fn pad_size_args(params: &[Param], st: &Staging) -> Option<Vec<Param>> {
    let i = params.iter().position(|p| p.name == "size")?;
    let RArg::List(items) = &params[i].arg else {
        return None;
    };
    let size: Vec<i64> = items
        .iter()
        .map(|a| match a {
            RArg::Int(v) => Some(*v),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let padded = crate::exec::tensors(params)
        .into_iter()
        .find(|(path, t)| t.view.sizes == size && st.staged.contains_key(path))
        .and_then(|(path, t)| st.padded(path, t))?;
    let mut out = params.to_vec();
    out[i].arg = RArg::List(padded.into_iter().map(RArg::Int).collect());
    Some(out)
}

/// A staged tensor's storage as the flat buffer of `layout` for the program to read its
/// view from: the padded one a bucketed program left there, its exact buffer when the
/// layout is exact, or (when something replaced or compacted it since the op was queued)
/// its elements copied into a buffer of that layout.
pub(crate) fn padded_input(
    rt: &Runtime,
    s: &crate::storage::Storage,
    dtype: DType,
    layout: &Padded,
) -> Result<Arc<pjrt::Buffer>> {
    if let Some(b) = s.padded_now(dtype, layout) {
        return Ok(b);
    }
    let exact = s.buffer_now(rt, dtype)?;
    if layout.is_exact() {
        return Ok(exact);
    }
    let bytes = rt.download(&exact)?;
    rt.metrics
        .bucket_host_bytes
        .fetch_add(bytes.len() as u64, Relaxed);
    let n: i64 = layout.padded.iter().product();
    let mut out = vec![0u8; n as usize * dtype.size()];
    // SAFETY: the padded view indexes inside `out`.
    unsafe { crate::host::write(out.as_mut_ptr(), &layout.view(), dtype.size(), &bytes) };
    Ok(Arc::new(rt.upload(&out, dtype, &[n], s.device)?))
}

/// The exact elements of a storage whose buffer is padded (`Storage::unpack`).
pub(crate) fn unpadded(
    rt: &Runtime,
    buf: &pjrt::Buffer,
    dtype: DType,
    layout: &Padded,
) -> Result<Arc<pjrt::Buffer>> {
    let bytes = unpad(rt, buf, dtype, layout)?;
    let n = layout.real.iter().product::<i64>();
    Ok(Arc::new(rt.upload(&bytes, dtype, &[n], buf.device())?))
}

/// A view of a storage whose buffer is padded, in the buffer's terms: the offset and the
/// stride of each view dim in the padded layout, and the view dims that run over several
/// of the storage's dims (a `[B*T, C]` view of `[B, T, C]` with `T` padded: no one stride
/// reaches its elements), each with those storage dims, outer first; their stride in
/// `view` is `MERGED`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ReadView {
    pub view: View,
    pub merged: Vec<(usize, Vec<usize>)>,
}

/// The stride of a merged view dim (see `ReadView`): negative, so no row is read across it.
pub(crate) const MERGED: i64 = i64::MIN;

/// `v`, a view of a storage holding `p`, in the padded buffer's terms (see `ReadView`);
/// None when a view dim is no run of the storage's dims (an `as_strided` across them).
pub(crate) fn read_in(v: &View, p: &Padded) -> Option<ReadView> {
    if p.is_exact() {
        return Some(ReadView {
            view: v.clone(),
            merged: Vec::new(),
        });
    }
    let (real, padded) = (&p.real, lowering::shape::contiguous_strides(&p.padded));
    let strides = lowering::shape::contiguous_strides(real);
    let total: i64 = real.iter().product();
    if v.offset < 0 || v.offset >= total.max(1) {
        return None;
    }
    // The offset's digit in each storage dim.
    let digit: Vec<i64> = (0..real.len())
        .map(|j| v.offset / strides[j] % real[j])
        .collect();
    let mut out = View {
        sizes: v.sizes.clone(),
        strides: vec![0; v.sizes.len()],
        offset: (0..real.len()).map(|j| digit[j] * padded[j]).sum(),
    };
    let mut merged = Vec::new();
    // How far the view reaches in each storage dim, from the offset's digit; the storage
    // dims a merged view dim runs over whole (no other view dim may step through them).
    let mut reach = digit.clone();
    let mut whole = vec![false; real.len()];
    let mut stepped = vec![false; real.len()];
    for (k, (&n, &s)) in v.sizes.iter().zip(&v.strides).enumerate() {
        if n == 1 || s == 0 {
            continue;
        }
        // The storage dim it steps through (`q` of its elements at a time: a split of
        // that dim, such as [B, T] over a [B*T] dim, steps by T).
        let m = (0..real.len())
            .find(|&j| real[j] > 1 && s % strides[j] == 0 && s / strides[j] < real[j])?;
        let q = s / strides[m];
        if q > 1 || digit[m] + n <= real[m] {
            out.strides[k] = q * padded[m];
            reach[m] += (n - 1) * q;
            stepped[m] = true;
            continue;
        }
        // A run of storage dims, inner ones whole from digit 0, the outermost partly.
        let mut dims = vec![m];
        let mut left = n;
        let mut j = m;
        loop {
            if digit[j] != 0 || left % real[j] != 0 || whole[j] {
                return None;
            }
            whole[j] = true;
            left /= real[j];
            j = (0..j).rev().find(|&i| real[i] > 1)?;
            dims.push(j);
            if left <= real[j] {
                break;
            }
        }
        reach[j] += left - 1;
        stepped[j] = true;
        dims.reverse();
        if dims[1..].iter().all(|d| p.padded[*d] == real[*d]) {
            // Inner dims without padding: a run of the padded buffer too ([T, H*D] over
            // [T, H, D]).
            out.strides[k] = padded[m];
        } else {
            out.strides[k] = MERGED;
            merged.push((k, dims));
        }
    }
    // No view dim runs past its storage dim (into the next one's digit), and none steps
    // through a dim a merged one runs over whole.
    for j in 0..real.len() {
        if reach[j] >= real[j].max(1) || whole[j] && stepped[j] {
            return None;
        }
    }
    Some(ReadView { view: out, merged })
}

/// Where the last row of `read` (its innermost dim left out) starts in the buffer of
/// `layout`: a merged dim's last index in the real sizes of the storage dims it runs over.
pub(crate) fn last_row_start(read: &ReadView, layout: &Padded) -> i64 {
    let v = &read.view;
    let padded = lowering::shape::contiguous_strides(&layout.padded);
    let Some(last) = v.sizes.len().checked_sub(1) else {
        return v.offset;
    };
    let mut start = v.offset;
    for d in 0..last {
        let i = v.sizes[d] - 1;
        start += match read.merged.iter().find(|m| m.0 == d) {
            Some((_, over)) => {
                let (mut inner, mut at) = (1, 0);
                for (k, j) in over.iter().enumerate().rev() {
                    let digit = if k == 0 {
                        i / inner
                    } else {
                        i / inner % layout.real[*j]
                    };
                    at += digit * padded[*j];
                    inner *= layout.real[*j];
                }
                at
            }
            None => i * v.strides[d],
        };
    }
    start
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::layout::view;

    #[test]
    fn a_size_is_steady_after_consecutive_steps_of_its_signature() {
        let mut h = DimHistory::default();
        // The signature's steps 2, 4, 6 (two optimizers a step): three in a row.
        assert_eq!(h.in_a_row(48, 2, 0), 1);
        assert_eq!(h.in_a_row(48, 2, 0), 1, "a step counts once");
        assert_eq!(h.in_a_row(48, 4, 2), 2);
        assert_eq!(h.in_a_row(40, 4, 2), 1);
        assert_eq!(h.in_a_row(48, 6, 4), 3);
        // A step of the signature without it breaks the run.
        assert_eq!(h.in_a_row(40, 10, 8), 1);
        assert_eq!(h.in_a_row(48, 12, 10), 1);
    }

    #[test]
    fn a_class_is_dynamic_at_its_second_size_or_by_growth() {
        let mut h = DimHistory::default();
        h.note(64);
        h.note(128);
        assert!(
            !h.varies(64) && !h.varies(128),
            "sizes of other classes: call sites"
        );
        h.note(100);
        assert!(h.varies(100) && h.varies(128) && !h.varies(64));
        // Past every size seen where a class varies: a longer cache, at first sight.
        h.note(300);
        assert!(h.varies(300) && !h.varies(1));
    }

    #[test]
    fn views_of_a_padded_storage_in_its_buffer() {
        // [2, 5, 3] held in [2, 8, 3].
        let p = Padded {
            padded: vec![2, 8, 3],
            real: vec![2, 5, 3],
        };
        // The tensor itself, a transpose, a narrow along the padded dim.
        let r = read_in(&view(&[2, 5, 3], &[15, 3, 1], 0), &p).unwrap();
        assert_eq!((r.view.strides, r.view.offset), (vec![24, 3, 1], 0));
        let r = read_in(&view(&[5, 2, 3], &[3, 15, 1], 0), &p).unwrap();
        assert_eq!(r.view.strides, vec![3, 24, 1]);
        let r = read_in(&view(&[2, 3, 3], &[15, 3, 1], 6), &p).unwrap();
        assert_eq!((r.view.strides, r.view.offset), (vec![24, 3, 1], 6));
        let r = read_in(&view(&[2, 5, 3], &[15, 3, 1], 15), &p);
        assert!(r.is_none(), "past the end of dim 0: {r:?}");
        // [B*T, C]: one dim over the storage's first two.
        let r = read_in(&view(&[10, 3], &[3, 1], 0), &p).unwrap();
        assert_eq!(r.merged, vec![(0, vec![0, 1])]);
        assert_eq!(r.view.strides, vec![MERGED, 1]);
        // [B*T, C] held in [16, 3] (real [10, 3]) read as [B, T, C] = [2, 5, 3].
        let flat = Padded {
            padded: vec![16, 3],
            real: vec![10, 3],
        };
        let r = read_in(&view(&[2, 5, 3], &[15, 3, 1], 0), &flat).unwrap();
        assert_eq!((r.view.strides, r.merged.len()), (vec![15, 3, 1], 0));
        // [B*H, T, T] = [8, 5, 5] in [8, 8, 8] read as [B, H, T, T] = [2, 4, 5, 5].
        let heads = Padded {
            padded: vec![8, 8, 8],
            real: vec![8, 5, 5],
        };
        let r = read_in(&view(&[2, 4, 5, 5], &[100, 25, 5, 1], 0), &heads).unwrap();
        assert_eq!(r.view.strides, vec![256, 64, 8, 1]);
        // A transposed key [B*H, D, T] = [8, 3, 5] (T padded to 8) read as [B, T, H*D] =
        // [2, 5, 12]: H*D runs over D whole and steps through B*H with the batch dim; D is
        // not padded, so that is one stride.
        let key = Padded {
            padded: vec![8, 3, 8],
            real: vec![8, 3, 5],
        };
        let r = read_in(&view(&[2, 5, 12], &[60, 1, 5], 0), &key).unwrap();
        assert_eq!((r.view.strides, r.merged.len()), (vec![96, 1, 8], 0));
        // The same with D padded too: merged.
        let key = Padded {
            padded: vec![8, 4, 8],
            real: vec![8, 3, 5],
        };
        let r = read_in(&view(&[2, 5, 12], &[60, 1, 5], 0), &key).unwrap();
        assert_eq!(r.merged, vec![(2, vec![0, 1])]);
        assert_eq!(r.view.strides, vec![128, 1, MERGED]);
        // Past the batch dim's end: none.
        assert!(read_in(&view(&[2, 5, 16], &[60, 1, 5], 0), &key).is_none());
        // The second batch row only: [T, C] at offset 15 is a single dim.
        let r = read_in(&view(&[5, 3], &[3, 1], 15), &p).unwrap();
        assert_eq!((r.view.strides, r.view.offset), (vec![3, 1], 24));
        // Unpadded inner dims merge into one stride: [B, T, H*D] over [B, T, H, D].
        let heads = Padded {
            padded: vec![2, 8, 4, 3],
            real: vec![2, 5, 4, 3],
        };
        let r = read_in(&view(&[2, 5, 12], &[60, 12, 1], 0), &heads).unwrap();
        assert_eq!((r.view.strides, r.merged.len()), (vec![96, 12, 1], 0));
        // A flat view of all of it: three dims merged.
        let r = read_in(&view(&[30], &[1], 0), &p).unwrap();
        assert_eq!(r.merged, vec![(0, vec![0, 1, 2])]);
        // Rows of 6 that straddle two of T's rows but not a whole one: none.
        assert!(read_in(&view(&[5, 6], &[6, 1], 0), &p).is_none());
        // An exact layout keeps the view.
        let e = Padded::exact(30);
        let v = view(&[10, 3], &[3, 1], 0);
        assert_eq!(read_in(&v, &e).unwrap().view, v);
    }
}
