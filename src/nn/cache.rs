//! Caches for autoregressive inference that grow in place: a buffer with spare capacity along
//! the sequence, each step's rows written into it (`slice_assign` on a buffer nothing else
//! holds, which a backend may do without copying the buffer; not measured here), and views
//! of the filled part handed out. The capacity doubles when it runs out, so a sequence of `n`
//! positions copies O(n) rows in all, where concatenating a new tensor each step copies O(n²).

use std::ops::Range;

use burn::tensor::{Tensor, backend::Backend};

use super::rows;

/// Positions a cache allocates at first, at least.
const MIN_CAPACITY: usize = 64;

/// The capacity for `needed` positions: the hint, `needed`, or twice the current capacity.
fn grown(current: usize, needed: usize, hint: usize) -> usize {
    needed.max(hint).max(2 * current).max(MIN_CAPACITY)
}

/// The buffer both caches are: a `D`-dimensional tensor whose sequence axis (`D − 2`) has spare
/// capacity, the first `len` positions filled.
#[derive(Debug)]
struct SeqBuffer<B: Backend, const D: usize> {
    buffer: Option<Tensor<B, D>>,
    len: usize,
    /// Positions forgotten from the front ([`SeqBuffer::forget_before`]).
    dropped: usize,
    hint: usize,
    /// Who panics (`KvCache`, `RowCache`).
    who: &'static str,
}

impl<B: Backend, const D: usize> SeqBuffer<B, D> {
    const SEQ: usize = D - 2;

    fn new(hint: usize, who: &'static str) -> Self {
        Self {
            buffer: None,
            len: 0,
            dropped: 0,
            hint,
            who,
        }
    }

    /// Keeps the last `keep` positions held once at least `2·keep` are (a copy of `keep`
    /// positions into a new buffer, so each position is copied at most once on average): a
    /// rolling window over the sequence whose memory stays within `2·keep` plus one step's rows.
    fn forget_before(&mut self, keep: usize) {
        let keep = keep.max(1);
        if self.len < 2 * keep.max(MIN_CAPACITY / 2) {
            return;
        }
        let Some(buffer) = self.buffer.take() else {
            return;
        };
        let held = buffer.dims();
        let mut shape = held;
        shape[Self::SEQ] = grown(0, 2 * keep, self.hint.min(2 * keep));
        let kept = buffer.slice(Self::ranges(held, self.len - keep..self.len));
        let fresh = Tensor::<B, D>::empty(shape, (&kept.device(), kept.dtype()));
        self.buffer = Some(fresh.slice_assign(Self::ranges(held, 0..keep), kept));
        self.dropped += self.len - keep;
        self.len = keep;
    }

    fn capacity(&self) -> usize {
        self.buffer.as_ref().map_or(0, |b| b.dims()[Self::SEQ])
    }

    /// Every axis whole but the sequence, which takes `seq`.
    fn ranges(dims: [usize; D], seq: Range<usize>) -> [Range<usize>; D] {
        std::array::from_fn(|d| {
            if d == Self::SEQ {
                seq.clone()
            } else {
                0..dims[d]
            }
        })
    }

    /// Every position held (a view of the buffer). Panics when empty.
    fn view(&self) -> Tensor<B, D> {
        let who = self.who;
        let buffer = self
            .buffer
            .clone()
            .unwrap_or_else(|| panic!("{who}: nothing held"));
        let dims = buffer.dims();
        buffer.slice(Self::ranges(dims, 0..self.len))
    }

    /// Appends `rows` (the shape of what is held but along the sequence) and returns every
    /// position held.
    fn append(&mut self, rows: Tensor<B, D>) -> Tensor<B, D> {
        let dims = rows.dims();
        let needed = self.len + dims[Self::SEQ];
        let other = |d: [usize; D]| {
            let mut d = d;
            d[Self::SEQ] = 0;
            d
        };
        let mut buffer = match self.buffer.take() {
            Some(buffer) => {
                let held = buffer.dims();
                assert_eq!(
                    other(held),
                    other(dims),
                    "{}: appending rows of shape {dims:?} to a cache of {held:?}",
                    self.who
                );
                let cap = held[Self::SEQ];
                if needed > cap {
                    let mut shape = held;
                    shape[Self::SEQ] = grown(cap, needed, self.hint);
                    let bigger = Tensor::<B, D>::empty(shape, (&rows.device(), rows.dtype()));
                    let filled = Self::ranges(held, 0..self.len);
                    bigger.slice_assign(filled.clone(), buffer.slice(filled))
                } else {
                    buffer
                }
            }
            None => {
                let mut shape = dims;
                shape[Self::SEQ] = grown(0, needed, self.hint);
                Tensor::<B, D>::empty(shape, (&rows.device(), rows.dtype()))
            }
        };
        buffer = buffer.slice_assign(Self::ranges(dims, self.len..needed), rows);
        self.len = needed;
        self.buffer = Some(buffer);
        self.view()
    }
}

/// Keys or values of the positions seen so far, `[B, H, len, D]`, in a `[B, H, capacity, D]`
/// buffer.
#[derive(Debug)]
pub struct KvCache<B: Backend>(SeqBuffer<B, 4>);

impl<B: Backend> Default for KvCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> KvCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty cache that allocates room for `positions` at once (no regrowth up to there).
    pub fn with_capacity(positions: usize) -> Self {
        Self(SeqBuffer::new(positions, "KvCache"))
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Positions appended since the cache was made: those held and those forgotten
    /// ([`KvCache::forget_before`]).
    pub fn seen(&self) -> usize {
        self.0.dropped + self.0.len
    }

    /// Positions forgotten from the front.
    pub fn forgotten(&self) -> usize {
        self.0.dropped
    }

    /// Keeps (at least) the last `keep` positions: once `2·keep` are held the older ones are
    /// dropped, so a sliding-window model's cache stays within `2·keep` positions plus a step's.
    pub fn forget_before(&mut self, keep: usize) {
        self.0.forget_before(keep)
    }

    /// Positions the buffer holds before it grows.
    pub fn capacity(&self) -> usize {
        self.0.capacity()
    }

    /// Every position held, `[B, H, len, D]` (a view of the buffer). Panics when empty.
    pub fn view(&self) -> Tensor<B, 4> {
        self.0.view()
    }

    /// Appends `rows` (`[B, H, n, D]`, the batch, heads and width of what is held) and returns
    /// every position held, `[B, H, len, D]` (a view of the buffer).
    pub fn append(&mut self, rows: Tensor<B, 4>) -> Tensor<B, 4> {
        self.0.append(rows)
    }
}

/// Rows of a `[B, S, D]` activation computed so far, in a `[B, capacity, D]` buffer: burn-nn's
/// autoregressive `TensorCache` (each call passes the whole sequence so far; only the rows the
/// cache has not seen are computed), growing in place.
#[derive(Debug)]
pub struct RowCache<B: Backend>(SeqBuffer<B, 3>);

impl<B: Backend> Default for RowCache<B> {
    fn default() -> Self {
        Self::new()
    }
}

impl<B: Backend> RowCache<B> {
    /// An empty cache.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty cache that allocates room for `positions` at once.
    pub fn with_capacity(positions: usize) -> Self {
        Self(SeqBuffer::new(positions, "RowCache"))
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// `f` of every row of `input` (`[B, S, D]`, the whole sequence so far): `f` runs on the
    /// rows past the ones held (`f` must be row-wise), and every row's result comes back,
    /// `[B, S, D']`. Panics when `input` has fewer rows than the cache holds.
    pub fn forward(
        &mut self,
        input: Tensor<B, 3>,
        f: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let seq = input.dims()[1];
        self.extend("RowCache", "input", seq, |new| f(rows(input, new)))
    }

    /// Every row of a sequence of `seq` positions: the rows past the ones held are computed
    /// by `f` from their positions (`held..seq`) and appended. Panics, naming `who` and its
    /// `input`, when the sequence is shorter than what the cache holds.
    pub(crate) fn extend(
        &mut self,
        who: &str,
        input: &str,
        seq: usize,
        f: impl FnOnce(Range<usize>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let held = self.len();
        assert!(
            seq >= held,
            "{who}: the {input} has {seq} positions, the cache already holds {held} (a new sequence needs a new cache)"
        );
        if seq == held {
            return self.view();
        }
        self.append(f(held..seq))
    }

    /// Appends rows (`[B, n, D]`) and returns every row held.
    pub fn append(&mut self, rows: Tensor<B, 3>) -> Tensor<B, 3> {
        self.0.append(rows)
    }

    /// Every row held, `[B, len, D]` (a view of the buffer). Panics when empty.
    pub fn view(&self) -> Tensor<B, 3> {
        self.0.view()
    }
}
