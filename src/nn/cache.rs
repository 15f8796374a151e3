//! Caches for autoregressive inference that grow in place: a buffer with spare capacity along
//! the sequence, each step's rows written into it (`slice_assign` on a buffer nothing else
//! holds, which a backend may do without copying the buffer; not measured here), and views
//! of the filled part handed out. The capacity doubles when it runs out, so a sequence of `n`
//! positions copies O(n) rows in all, where concatenating a new tensor each step copies O(n²).

use burn::tensor::{Tensor, backend::Backend};

/// Positions a cache allocates at first, at least.
const MIN_CAPACITY: usize = 64;

/// The capacity for `needed` positions: the hint, `needed`, or twice the current capacity.
fn grown(current: usize, needed: usize, hint: usize) -> usize {
    needed.max(hint).max(2 * current).max(MIN_CAPACITY)
}

/// Keys or values of the positions seen so far, `[B, H, len, D]`, in a `[B, H, capacity, D]`
/// buffer.
#[derive(Debug)]
pub struct KvCache<B: Backend> {
    buffer: Option<Tensor<B, 4>>,
    len: usize,
    hint: usize,
}

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
        Self {
            buffer: None,
            len: 0,
            hint: positions,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffer holds before it grows.
    pub fn capacity(&self) -> usize {
        self.buffer.as_ref().map_or(0, |b| b.dims()[2])
    }

    /// Every position held, `[B, H, len, D]` (a view of the buffer). Panics when empty.
    pub fn view(&self) -> Tensor<B, 4> {
        let buffer = self.buffer.clone().expect("KvCache: nothing held");
        let [batch, heads, _, d] = buffer.dims();
        buffer.slice([0..batch, 0..heads, 0..self.len, 0..d])
    }

    /// Appends `rows` (`[B, H, n, D]`, the batch, heads and width of what is held) and returns
    /// every position held, `[B, H, len, D]` (a view of the buffer).
    pub fn append(&mut self, rows: Tensor<B, 4>) -> Tensor<B, 4> {
        let [batch, heads, n, d] = rows.dims();
        let needed = self.len + n;
        let mut buffer = match self.buffer.take() {
            Some(buffer) => {
                let [b0, h0, cap, d0] = buffer.dims();
                assert_eq!(
                    [b0, h0, d0],
                    [batch, heads, d],
                    "KvCache: appending rows of [batch, heads, width] {:?} to a cache of {:?}",
                    [batch, heads, d],
                    [b0, h0, d0]
                );
                if needed > cap {
                    let cap = grown(cap, needed, self.hint);
                    let bigger = Tensor::<B, 4>::empty(
                        [batch, heads, cap, d],
                        (&rows.device(), rows.dtype()),
                    );
                    bigger.slice_assign(
                        [0..batch, 0..heads, 0..self.len, 0..d],
                        buffer.slice([0..batch, 0..heads, 0..self.len, 0..d]),
                    )
                } else {
                    buffer
                }
            }
            None => {
                let cap = grown(0, needed, self.hint);
                Tensor::<B, 4>::empty([batch, heads, cap, d], (&rows.device(), rows.dtype()))
            }
        };
        buffer = buffer.slice_assign([0..batch, 0..heads, self.len..needed, 0..d], rows);
        self.len = needed;
        self.buffer = Some(buffer);
        self.view()
    }
}

/// Rows of a `[B, S, D]` activation computed so far, in a `[B, capacity, D]` buffer: burn-nn's
/// autoregressive `TensorCache` (each call passes the whole sequence so far; only the rows the
/// cache has not seen are computed), growing in place.
#[derive(Debug)]
pub struct RowCache<B: Backend> {
    buffer: Option<Tensor<B, 3>>,
    len: usize,
    hint: usize,
}

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
        Self {
            buffer: None,
            len: 0,
            hint: positions,
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `f` of every row of `input` (`[B, S, D]`, the whole sequence so far): `f` runs on the
    /// rows past the ones held (`f` must be row-wise), and every row's result comes back,
    /// `[B, S, D']`. Panics when `input` has fewer rows than the cache holds.
    pub fn forward(
        &mut self,
        input: Tensor<B, 3>,
        f: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let [batch, seq, width] = input.dims();
        assert!(
            seq >= self.len,
            "RowCache: the input has {seq} positions, the cache already holds {} (a new sequence needs a new cache)",
            self.len
        );
        if seq == self.len {
            return self.view();
        }
        let new = if self.len == 0 {
            input
        } else {
            input.slice([0..batch, self.len..seq, 0..width])
        };
        self.append(f(new))
    }

    /// Appends rows (`[B, n, D]`) and returns every row held.
    pub fn append(&mut self, rows: Tensor<B, 3>) -> Tensor<B, 3> {
        let [batch, n, d] = rows.dims();
        let needed = self.len + n;
        let mut buffer = match self.buffer.take() {
            Some(buffer) => {
                let [b0, cap, d0] = buffer.dims();
                assert_eq!(
                    [b0, d0],
                    [batch, d],
                    "RowCache: appending rows of [batch, width] {:?} to a cache of {:?}",
                    [batch, d],
                    [b0, d0]
                );
                if needed > cap {
                    let cap = grown(cap, needed, self.hint);
                    let bigger =
                        Tensor::<B, 3>::empty([batch, cap, d], (&rows.device(), rows.dtype()));
                    bigger.slice_assign(
                        [0..batch, 0..self.len, 0..d],
                        buffer.slice([0..batch, 0..self.len, 0..d]),
                    )
                } else {
                    buffer
                }
            }
            None => {
                let cap = grown(0, needed, self.hint);
                Tensor::<B, 3>::empty([batch, cap, d], (&rows.device(), rows.dtype()))
            }
        };
        buffer = buffer.slice_assign([0..batch, self.len..needed, 0..d], rows);
        self.len = needed;
        self.buffer = Some(buffer);
        self.view()
    }

    /// Every row held, `[B, len, D]` (a view of the buffer). Panics when empty.
    pub fn view(&self) -> Tensor<B, 3> {
        let buffer = self.buffer.clone().expect("RowCache: nothing held");
        let [batch, _, d] = buffer.dims();
        buffer.slice([0..batch, 0..self.len, 0..d])
    }
}
