//! Packed variable-length batches (FlashAttention's `flash_attn_varlen_func`, PyTorch's
//! `varlen_attn`): sequences of different lengths end to end in one `[total, H, D]` tensor,
//! described by their cumulative lengths, so that no work or memory goes to padding.
//!
//! The kernels run the call as one batch whose rows each see only their own sequence's keys:
//! a third rule beside the causal mask and the sliding window, which give every row a range of
//! keys ([`burn_flash_kernels::flash::keys::key_range`]). Key blocks outside every row's
//! range are skipped forward and backward, so a row block pays for the keys of the sequences
//! it holds, not for the packed total.

use burn::tensor::{Bool, Int, Tensor, TensorData, backend::Backend};

use super::{FlashAttentionOptions, HeadTerms, OP, attention_checked};
use crate::FlashBackend;

/// The sequences of a packed batch: `n` sequences, sequence `b` holding query tokens
/// `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` and key tokens `cu_seqlens_k[b] ..
/// cu_seqlens_k[b + 1]` of the packed tensors. Checked once when made; the device copy the
/// kernels read is made then too.
#[derive(Debug, Clone)]
pub struct VarlenBatch<B: Backend> {
    cu_q: Vec<usize>,
    cu_k: Vec<usize>,
    /// `[2·(n + 1)]`: `cu_q`, then `cu_k`.
    seqs: Tensor<B, 1, Int>,
}

impl<B: Backend> VarlenBatch<B> {
    /// The batch of sequences with `lengths_q[b]` query tokens and `lengths_k[b]` key tokens
    /// (host values: nothing is read back from the device).
    ///
    /// # Panics
    /// When the two lists differ in length, are empty, or the tokens add up to 2³¹ or more.
    pub fn from_lengths(lengths_q: &[usize], lengths_k: &[usize], device: &B::Device) -> Self {
        if lengths_q.len() != lengths_k.len() {
            panic!(
                "{OP}: {} query lengths but {} key lengths (one of each per sequence)",
                lengths_q.len(),
                lengths_k.len()
            );
        }
        let cumulative = |lengths: &[usize]| {
            let mut cu = Vec::with_capacity(lengths.len() + 1);
            cu.push(0usize);
            for &l in lengths {
                cu.push(cu[cu.len() - 1] + l);
            }
            cu
        };
        Self::new(cumulative(lengths_q), cumulative(lengths_k), device)
    }

    /// Self-attention over sequences of `lengths` tokens (queries and keys alike).
    ///
    /// # Panics
    /// As [`VarlenBatch::from_lengths`].
    pub fn self_attention(lengths: &[usize], device: &B::Device) -> Self {
        Self::from_lengths(lengths, lengths, device)
    }

    /// FlashAttention's arguments: the cumulative lengths `cu_seqlens_q`, `cu_seqlens_k`
    /// (`[n + 1]` each, starting at 0) and the longest sequence of each. Both tensors are read
    /// to the host to be checked (one wait for the device); [`VarlenBatch::from_lengths`]
    /// avoids it where the lengths are known on the host.
    ///
    /// # Panics
    /// When a tensor does not start at 0 or decreases, the two differ in length or have fewer
    /// than 2 entries, a sequence is longer than its `max_seqlen`, or the tokens add up to 2³¹
    /// or more.
    pub fn from_cu_seqlens(
        cu_seqlens_q: Tensor<B, 1, Int>,
        cu_seqlens_k: Tensor<B, 1, Int>,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
    ) -> Self {
        let device = cu_seqlens_q.device();
        let read = |name: &str, t: Tensor<B, 1, Int>| -> Vec<usize> {
            let values: Vec<i64> = t
                .into_data()
                .convert::<i64>()
                .to_vec()
                .unwrap_or_else(|e| panic!("{OP}: `{name}` could not be read: {e:?}"));
            values
                .iter()
                .enumerate()
                .map(|(b, &x)| {
                    usize::try_from(x)
                        .unwrap_or_else(|_| panic!("{OP}: `{name}`[{b}] is negative ({x})"))
                })
                .collect()
        };
        let cu_q = read("cu_seqlens_q", cu_seqlens_q);
        let cu_k = read("cu_seqlens_k", cu_seqlens_k);
        let batch = Self::new(cu_q, cu_k, &device);
        for (name, got, max) in [
            ("max_seqlen_q", batch.max_seqlen_q(), max_seqlen_q),
            ("max_seqlen_k", batch.max_seqlen_k(), max_seqlen_k),
        ] {
            if got > max {
                panic!("{OP}: a sequence has {got} tokens, more than `{name}` = {max}");
            }
        }
        batch
    }

    /// Checks cumulative lengths and makes the device copy.
    fn new(cu_q: Vec<usize>, cu_k: Vec<usize>, device: &B::Device) -> Self {
        if cu_q.len() != cu_k.len() {
            panic!(
                "{OP}: `cu_seqlens_q` has {} entries, `cu_seqlens_k` {} (n + 1 each for n sequences)",
                cu_q.len(),
                cu_k.len()
            );
        }
        if cu_q.len() < 2 {
            panic!("{OP}: a packed batch needs at least one sequence");
        }
        for (name, cu) in [("cu_seqlens_q", &cu_q), ("cu_seqlens_k", &cu_k)] {
            if cu[0] != 0 {
                panic!("{OP}: `{name}` must start at 0, got {}", cu[0]);
            }
            if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
                panic!(
                    "{OP}: `{name}` must not decrease: entry {} is {} after {}",
                    b + 1,
                    cu[b + 1],
                    cu[b]
                );
            }
            let total = cu[cu.len() - 1];
            if total >= 1 << 31 {
                panic!("{OP}: `{name}` adds up to {total} tokens; at most 2³¹ − 1 are indexed");
            }
        }
        let words: Vec<i32> = cu_q.iter().chain(&cu_k).map(|&x| x as i32).collect();
        let n = words.len();
        let seqs = Tensor::from_data(TensorData::new(words, [n]), device);
        Self { cu_q, cu_k, seqs }
    }

    /// The number of sequences.
    pub fn sequences(&self) -> usize {
        self.cu_q.len() - 1
    }

    /// The cumulative query lengths `[n + 1]`.
    pub fn cu_seqlens_q(&self) -> &[usize] {
        &self.cu_q
    }

    /// The cumulative key lengths `[n + 1]`.
    pub fn cu_seqlens_k(&self) -> &[usize] {
        &self.cu_k
    }

    /// Query tokens of all sequences.
    pub fn total_q(&self) -> usize {
        self.cu_q[self.cu_q.len() - 1]
    }

    /// Key tokens of all sequences.
    pub fn total_k(&self) -> usize {
        self.cu_k[self.cu_k.len() - 1]
    }

    /// The longest sequence's query tokens.
    pub fn max_seqlen_q(&self) -> usize {
        longest(&self.cu_q)
    }

    /// The longest sequence's key tokens.
    pub fn max_seqlen_k(&self) -> usize {
        longest(&self.cu_k)
    }

    /// The device the kernels read the lengths on.
    pub fn device(&self) -> B::Device {
        self.seqs.device()
    }
}

/// The longest run of cumulative lengths `cu`.
fn longest(cu: &[usize]) -> usize {
    cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
}

/// Attention over a packed variable-length batch: each sequence of `batch` attends to its own
/// keys only, with every option of [`super::attention_with_heads`] applied per sequence (the
/// causal mask and the window bottom-right aligned in each sequence, ALiBi's distance from
/// each sequence's diagonal, GQA, softcap, quiet softmax, sinks, dropout) — the dense call on
/// each sequence, without the padding.
///
/// Shapes: `query` `[Tq, Hq, D]`, `key` `[Tk, Hkv, D]`, `value` `[Tk, Hkv, Dv]` with `Tq`,
/// `Tk` the batch's totals; `mask` and `attn_bias` in packed coordinates, broadcasting to `[1,
/// Hq, Tq, Tk]` (a key padding mask is `[1, 1, 1, Tk]`; entries across sequences are never
/// read). Returns the output `[Tq, Hq, Dv]` and the row log-sum-exp `[Hq, Tq]` (f32; −inf for a
/// row that sees no key, e.g. a sequence without keys, whose output is zeros). Dropout draws
/// from the packed coordinates (batch 0, packed query position, packed key). Under `Autodiff`
/// gradients flow to `query`, `key`, `value`, a tracked bias and the sinks.
///
/// # Panics
/// As [`super::attention_with_heads`], and when `query` or `key`/`value` do not hold the
/// batch's total tokens, or the batch is on another device.
///
/// ```no_run
/// use burn::backend::Wgpu;
/// use burn::tensor::{Distribution, Tensor, ops::AttentionModuleOptions};
/// use burn_flash::{FlashAttentionOptions, HeadTerms, VarlenBatch, attention_varlen};
///
/// let device = Default::default();
/// // Three prompts of 5, 300 and 17 tokens, 8 query heads sharing 2 key/value heads.
/// let batch = VarlenBatch::<Wgpu>::self_attention(&[5, 300, 17], &device);
/// let q = Tensor::<Wgpu, 3>::random([322, 8, 64], Distribution::Default, &device);
/// let k = Tensor::<Wgpu, 3>::random([322, 2, 64], Distribution::Default, &device);
/// let v = Tensor::<Wgpu, 3>::random([322, 2, 64], Distribution::Default, &device);
/// let options: FlashAttentionOptions =
///     AttentionModuleOptions { is_causal: true, ..Default::default() }.into();
/// let (out, lse) = attention_varlen(q, k, v, &batch, None, None, HeadTerms::default(), options);
/// assert_eq!(out.dims(), [322, 8, 64]);
/// assert_eq!(lse.dims(), [8, 322]);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_varlen<B: FlashBackend>(
    query: Tensor<B, 3>,
    key: Tensor<B, 3>,
    value: Tensor<B, 3>,
    batch: &VarlenBatch<B>,
    mask: Option<Tensor<B, 4, Bool>>,
    attn_bias: Option<Tensor<B, 4>>,
    heads: HeadTerms<B>,
    options: FlashAttentionOptions,
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    for (name, tokens, total, cu) in [
        ("query", query.dims()[0], batch.total_q(), "cu_seqlens_q"),
        ("key", key.dims()[0], batch.total_k(), "cu_seqlens_k"),
        ("value", value.dims()[0], batch.total_k(), "cu_seqlens_k"),
    ] {
        if tokens != total {
            panic!(
                "{OP}: `{name}` has {tokens} tokens, but `{cu}` ends at {total} (shape [total, heads, dim])"
            );
        }
    }
    let device = query.device();
    let seqs_device = batch.device();
    if seqs_device != device {
        panic!("{OP}: the varlen batch is on {seqs_device:?}, `query` on {device:?}");
    }
    // `[T, H, D]` as one batch `[1, H, T, D]`: a view, no copy.
    let heads_first = |t: Tensor<B, 3>| t.unsqueeze_dim::<4>(0).swap_dims(1, 2);
    let (out, lse) = attention_checked(
        heads_first(query),
        heads_first(key),
        heads_first(value),
        mask,
        attn_bias,
        heads,
        Some(batch.seqs.clone()),
        options,
    );
    (
        out.swap_dims(1, 2).squeeze_dim::<3>(0),
        lse.squeeze_dim::<2>(0),
    )
}
