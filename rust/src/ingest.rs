//! The fast path of `Sketch::update`: chunked, branch-light loops over float32 bits.
//!
//! Per chunk of `CHUNK` values, one vectorizable pass gathers the moments, extremes and the
//! counts that say whether the chunk is ordinary (no NaN/Inf, no float32 subnormals). A
//! second pass increments bucket counters in a thread-local scratch table keyed directly by
//! `|bits| >> (23 - m)`, spread over `LANES` copies so that runs of equal keys do not wait
//! on each other's stores. The scratch is folded into the sketch's histogram once per
//! update. Chunks holding NaN/Inf take the one-value-at-a-time reference path; float32
//! subnormals are placed by a rescan of their chunk. Both are rare in real tensors.

use std::cell::RefCell;

use crate::histogram::{self, F32_INF_BITS, F32_MIN_NORMAL_BITS};
use crate::sketch::Sketch;

/// Values per chunk: 8 KiB of float32, so the second pass reads from L1.
pub const CHUNK: usize = 2048;
/// Copies of the scratch counters.
const LANES: usize = 4;
/// Below this many values an update goes straight through the reference path, which
/// skips the fold.
pub const SMALL_UPDATE: usize = 256;
/// Fold before any scratch counter could reach 2^32.
const FOLD_EVERY: u64 = 1 << 31;

/// The format values arrived in, which decides what counts as subnormal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    F32,
    F16,
    Bf16,
}

impl Source {
    /// Float32 bits of |x| below which a value is subnormal in its source format.
    pub fn subnormal_below_bits(self) -> u32 {
        match self {
            Source::F32 | Source::Bf16 => F32_MIN_NORMAL_BITS,
            Source::F16 => (127 - 14) << 23, // 2^-14, float16's smallest normal
        }
    }
}

pub fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s as u32) << 16);
    }
}

/// What the first pass learns about a chunk.
#[derive(Clone, Copy, Debug)]
struct ChunkScan {
    sum: f64,
    sum_sq: f64,
    /// Signed extremes as order-preserving integers (see `ordered`).
    min_ordered: i32,
    max_ordered: i32,
    max_abs_bits: u32,
    min_abs_bits: u32,
    zeros: u32,
    source_subnormals: u32,
    /// Zeros and float32 subnormals.
    below_normal: u32,
    /// Normal values that sit on the lower edge of their bucket.
    edges: u32,
}

/// Map float bits to integers that sort like the floats (for non-NaN values).
#[inline(always)]
fn ordered(bits: u32) -> i32 {
    let i = bits as i32;
    i ^ (((i >> 31) as u32) >> 1) as i32
}

#[inline(always)]
fn unordered(o: i32) -> f32 {
    f32::from_bits((o ^ (((o >> 31) as u32) >> 1) as i32) as u32)
}

#[inline(always)]
fn scan_generic(values: &[f32], subnormal_below: u32, low_mask: u32) -> ChunkScan {
    const W: usize = 8;
    let mut sum = [0f64; W];
    let mut sum_sq = [0f64; W];
    let mut min_o = [i32::MAX; W];
    let mut max_o = [i32::MIN; W];
    let mut max_a = [0u32; W];
    let mut min_a = [u32::MAX; W];
    let mut zeros = [0u32; W];
    let mut sub = [0u32; W];
    let mut below = [0u32; W];
    let mut edges = [0u32; W];
    let mut step = |j: usize, x: f32| {
        let bits = x.to_bits();
        let a = bits & 0x7fff_ffff;
        let v = x as f64;
        sum[j] += v;
        sum_sq[j] += v * v;
        let o = ordered(bits);
        min_o[j] = min_o[j].min(o);
        max_o[j] = max_o[j].max(o);
        max_a[j] = max_a[j].max(a);
        min_a[j] = min_a[j].min(a);
        zeros[j] += (a == 0) as u32;
        sub[j] += (a.wrapping_sub(1) < subnormal_below - 1) as u32;
        let is_below = a < F32_MIN_NORMAL_BITS;
        below[j] += is_below as u32;
        edges[j] += ((a & low_mask == 0) & !is_below) as u32;
    };
    let mut blocks = values.chunks_exact(W);
    for block in &mut blocks {
        for (j, &x) in block.iter().enumerate() {
            step(j, x);
        }
    }
    for (j, &x) in blocks.remainder().iter().enumerate() {
        step(j, x);
    }
    ChunkScan {
        sum: sum.iter().sum(),
        sum_sq: sum_sq.iter().sum(),
        min_ordered: *min_o.iter().min().unwrap(),
        max_ordered: *max_o.iter().max().unwrap(),
        max_abs_bits: *max_a.iter().max().unwrap(),
        min_abs_bits: *min_a.iter().min().unwrap(),
        zeros: zeros.iter().sum(),
        source_subnormals: sub.iter().sum(),
        below_normal: below.iter().sum(),
        edges: edges.iter().sum(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_avx2(values: &[f32], subnormal_below: u32, low_mask: u32) -> ChunkScan {
    scan_generic(values, subnormal_below, low_mask)
}

fn scan(values: &[f32], subnormal_below: u32, low_mask: u32) -> ChunkScan {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { scan_avx2(values, subnormal_below, low_mask) };
        }
    }
    scan_generic(values, subnormal_below, low_mask)
}

/// Thread-local counters for one resolution: `[2][LANES][256 << m]`, off-edge then edge.
struct Scratch {
    mantissa_bits: u32,
    counters: Vec<u32>,
}

impl Scratch {
    fn width(&self) -> usize {
        256 << self.mantissa_bits
    }
}

thread_local! {
    static SCRATCH_POOL: RefCell<Vec<Scratch>> = const { RefCell::new(Vec::new()) };
}

fn take_scratch(mantissa_bits: u32) -> Scratch {
    let found = SCRATCH_POOL.with(|pool| {
        let mut pool = pool.borrow_mut();
        let at = pool.iter().position(|s| s.mantissa_bits == mantissa_bits);
        at.map(|i| pool.swap_remove(i))
    });
    found.unwrap_or_else(|| Scratch {
        mantissa_bits,
        counters: vec![0; 2 * LANES * (256usize << mantissa_bits)],
    })
}

fn return_scratch(scratch: Scratch) {
    SCRATCH_POOL.with(|pool| pool.borrow_mut().push(scratch));
}

/// Increment `table[lane][key]` for every value, all counters of one kind.
#[inline(always)]
fn scatter(table: &mut [u32], width: usize, values: &[f32], drop: u32) {
    let (l0, rest) = table.split_at_mut(width);
    let (l1, rest) = rest.split_at_mut(width);
    let (l2, l3) = rest.split_at_mut(width);
    let mut quads = values.chunks_exact(LANES);
    for q in &mut quads {
        l0[((q[0].to_bits() & 0x7fff_ffff) >> drop) as usize] += 1;
        l1[((q[1].to_bits() & 0x7fff_ffff) >> drop) as usize] += 1;
        l2[((q[2].to_bits() & 0x7fff_ffff) >> drop) as usize] += 1;
        l3[((q[3].to_bits() & 0x7fff_ffff) >> drop) as usize] += 1;
    }
    for &x in quads.remainder() {
        l0[((x.to_bits() & 0x7fff_ffff) >> drop) as usize] += 1;
    }
}

/// Feeds values into a sketch; call `finish` to fold what it gathered.
pub struct Ingestor<'a> {
    sketch: &'a mut Sketch,
    source: Source,
    scratch: Option<Scratch>,
    /// Range of shifted keys touched in the scratch since the last fold.
    lo_raw: u32,
    hi_raw: u32,
    pending: u64,
}

impl<'a> Ingestor<'a> {
    pub fn new(sketch: &'a mut Sketch, source: Source) -> Self {
        Ingestor {
            sketch,
            source,
            scratch: None,
            lo_raw: u32::MAX,
            hi_raw: 0,
            pending: 0,
        }
    }

    /// Add float32 values (any length).
    pub fn feed(&mut self, values: &[f32]) {
        for chunk in values.chunks(CHUNK) {
            self.feed_chunk(chunk);
        }
    }

    /// Add values of another type, converted to float32 one chunk at a time.
    pub fn feed_converted<T>(&mut self, values: &[T], convert: fn(&[T], &mut [f32])) {
        let mut buffer = [0f32; CHUNK];
        for chunk in values.chunks(CHUNK) {
            let out = &mut buffer[..chunk.len()];
            convert(chunk, out);
            self.feed(out);
        }
    }

    fn feed_chunk(&mut self, chunk: &[f32]) {
        let m = self.sketch.mantissa_bits();
        let drop = 23 - m;
        let low_mask = (1u32 << drop) - 1;
        let scan = scan(chunk, self.source.subnormal_below_bits(), low_mask);
        if scan.max_abs_bits >= F32_INF_BITS {
            for &x in chunk {
                self.sketch.insert_reference(x, self.source);
            }
            return;
        }
        let s = &mut *self.sketch;
        s.count += chunk.len() as u64;
        s.zeros += scan.zeros as u64;
        s.subnormals += scan.source_subnormals as u64;
        s.sum += scan.sum;
        s.sum_sq += scan.sum_sq;
        s.min = s.min.min(unordered(scan.min_ordered));
        s.max = s.max.max(unordered(scan.max_ordered));
        if scan.below_normal > scan.zeros {
            for &x in chunk {
                let a = x.to_bits() & 0x7fff_ffff;
                if a != 0 && a < F32_MIN_NORMAL_BITS {
                    let (key, edge) = histogram::key_of(a, m);
                    s.hist.add(key, 1, edge as u64);
                }
            }
        }
        let normals = chunk.len() as u32 - scan.below_normal;
        if normals == 0 {
            return;
        }
        // Zeros and subnormals also land in the scratch, below key 1 << m; the fold skips them.
        let scratch = self.scratch.get_or_insert_with(|| take_scratch(m));
        let width = scratch.width();
        let (off_edge, on_edge) = scratch.counters.split_at_mut(LANES * width);
        if scan.edges == 0 {
            scatter(off_edge, width, chunk, drop);
        } else if scan.edges == normals {
            scatter(on_edge, width, chunk, drop);
        } else {
            for &x in chunk {
                let a = x.to_bits() & 0x7fff_ffff;
                let table = if a & low_mask == 0 {
                    &mut *on_edge
                } else {
                    &mut *off_edge
                };
                table[(a >> drop) as usize] += 1;
            }
        }
        self.lo_raw = self
            .lo_raw
            .min(scan.min_abs_bits.max(F32_MIN_NORMAL_BITS) >> drop);
        self.hi_raw = self.hi_raw.max(scan.max_abs_bits >> drop);
        self.pending += chunk.len() as u64;
        if self.pending >= FOLD_EVERY {
            self.fold();
        }
    }

    /// Move the scratch counters into the histogram and clear them.
    fn fold(&mut self) {
        let Some(scratch) = self.scratch.as_mut() else {
            return;
        };
        if self.pending == 0 || self.lo_raw > self.hi_raw {
            return;
        }
        let m = scratch.mantissa_bits;
        let width = scratch.width();
        let (lo, hi) = (self.lo_raw as usize, self.hi_raw as usize);
        let first_key = histogram::key_of_raw_normal(self.lo_raw, m);
        let (counts, edges) = self.sketch.hist.slots_mut(first_key, hi - lo + 1);
        for (i, raw) in (lo..=hi).enumerate() {
            let mut off = 0u64;
            let mut on = 0u64;
            for lane in 0..LANES {
                let off_slot = &mut scratch.counters[lane * width + raw];
                off += *off_slot as u64;
                *off_slot = 0;
                let on_slot = &mut scratch.counters[(LANES + lane) * width + raw];
                on += *on_slot as u64;
                *on_slot = 0;
            }
            counts[i] += off + on;
            edges[i] += on;
        }
        // Zeros and subnormals were counted elsewhere: clear their scratch slots.
        for kind in 0..2 * LANES {
            scratch.counters[kind * width..kind * width + (1 << m)].fill(0);
        }
        self.sketch.hist.trim();
        self.lo_raw = u32::MAX;
        self.hi_raw = 0;
        self.pending = 0;
    }

    pub fn finish(mut self) {
        self.fold();
    }
}

impl Drop for Ingestor<'_> {
    fn drop(&mut self) {
        self.fold();
        if let Some(scratch) = self.scratch.take() {
            return_scratch(scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sketch::Sketch;
    use proptest::prelude::*;

    fn reference(values: &[f32], m: u32) -> Sketch {
        let mut s = Sketch::new(m);
        for &x in values {
            s.insert_reference(x, Source::F32);
        }
        s
    }

    fn assert_same(fast: &Sketch, slow: &Sketch) {
        assert_eq!(fast.hist, slow.hist);
        assert_eq!(
            (
                fast.count,
                fast.zeros,
                fast.subnormals,
                fast.nan,
                fast.pos_inf,
                fast.neg_inf
            ),
            (
                slow.count,
                slow.zeros,
                slow.subnormals,
                slow.nan,
                slow.pos_inf,
                slow.neg_inf
            )
        );
        assert_eq!(
            fast.min.to_bits() & 0x7fff_ffff,
            slow.min.to_bits() & 0x7fff_ffff
        );
        assert_eq!(
            fast.max.to_bits() & 0x7fff_ffff,
            slow.max.to_bits() & 0x7fff_ffff
        );
        // Summation order differs; both stay within float64 rounding of sum |x| <= sqrt(n sum_sq).
        let scale = (slow.sum_sq * slow.count as f64).sqrt();
        assert!((fast.sum - slow.sum).abs() <= 1e-12 * scale);
        assert!((fast.sum_sq - slow.sum_sq).abs() <= 1e-12 * slow.sum_sq);
    }

    fn lcg_values(n: usize, seed: u64, f: impl Fn(u64) -> f32) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                f(state >> 11)
            })
            .collect()
    }

    #[test]
    fn fast_path_matches_reference_on_mixed_data() {
        let values = lcg_values(20_000, 7, |r| {
            let u = (r as f64 / (1u64 << 53) as f64) as f32;
            match r % 97 {
                0 => 0.0,
                1 => f32::from_bits((r & 0x7f_ffff) as u32), // subnormal
                2 => 1.5,                                    // on an edge
                _ => (u - 0.5) * 10f32.powi((r % 13) as i32 - 6),
            }
        });
        for m in [3, 7, 10] {
            let mut fast = Sketch::new(m);
            fast.update_f32(&values);
            assert_same(&fast, &reference(&values, m));
        }
    }

    #[test]
    fn chunks_with_nan_and_inf_take_the_reference_path() {
        let mut values = lcg_values(5000, 3, |r| (r % 1000) as f32 - 500.0);
        values[10] = f32::NAN;
        values[3000] = f32::INFINITY;
        values[4999] = f32::NEG_INFINITY;
        let mut fast = Sketch::new(7);
        fast.update_f32(&values);
        assert_same(&fast, &reference(&values, 7));
        assert_eq!((fast.nan, fast.pos_inf, fast.neg_inf), (1, 1, 1));
    }

    #[test]
    fn bf16_values_are_all_edges() {
        let bits: Vec<u16> = (0..10_000u32).map(|i| (0x3f80 + i % 300) as u16).collect();
        let mut s = Sketch::new(7);
        s.update_bf16(&bits);
        let (_, counts, edges) = s.hist.parts();
        assert_eq!(counts, edges);
    }

    #[test]
    fn float16_subnormals_are_counted_as_subnormal() {
        let values: Vec<half::f16> = [1e-5f32, 1e-3, 0.0, 2.0, 6e-8]
            .iter()
            .cycle()
            .take(1000)
            .map(|&x| half::f16::from_f32(x))
            .collect();
        let mut s = Sketch::new(7);
        s.update_f16(&values);
        assert_eq!(s.subnormals, 400); // 1e-5 and 6e-8 are below 2^-14
        assert_eq!(s.zeros, 200);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn fast_path_equals_reference(bits in proptest::collection::vec(any::<u32>(), 0..3000), m in 3u32..=10) {
            let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            let mut fast = Sketch::new(m);
            fast.update_f32(&values);
            let slow = reference(&values, m);
            prop_assert_eq!(&fast.hist, &slow.hist);
            prop_assert_eq!(fast.count, slow.count);
            prop_assert_eq!(fast.nan, slow.nan);
            prop_assert_eq!(fast.subnormals, slow.subnormals);
            prop_assert_eq!(fast.zeros, slow.zeros);
        }

        #[test]
        fn fast_path_equals_reference_on_finite_values(values in proptest::collection::vec(-1e30f32..1e30f32, 0..5000)) {
            let mut fast = Sketch::new(7);
            fast.update_f32(&values);
            let slow = reference(&values, 7);
            prop_assert_eq!(&fast.hist, &slow.hist);
            prop_assert_eq!(fast.min, slow.min);
            prop_assert_eq!(fast.max, slow.max);
        }
    }
}
