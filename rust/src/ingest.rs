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
    /// Signed extremes (meaningful only when the chunk has no NaN).
    min: f32,
    max: f32,
    max_abs_bits: u32,
    /// Smallest nonzero |x| bits (u32::MAX when all are zero).
    min_nonzero_abs_bits: u32,
    zeros: u32,
    /// Values whose bits below the bucket resolution are all zero (zeros included).
    edges: u32,
}

/// The exact-integer and extreme-value half of a chunk scan, in `W` independent lanes so
/// that the compiler vectorizes it.
#[inline(always)]
fn scan_bits<const W: usize>(values: &[f32], low_mask: u32) -> ChunkScan {
    let mut min = [f32::INFINITY; W];
    let mut max = [f32::NEG_INFINITY; W];
    let mut max_a = [0u32; W];
    let mut min_nz = [u32::MAX; W];
    let mut zeros = [0u32; W];
    let mut edges = [0u32; W];
    let mut step = |j: usize, x: f32| {
        let a = x.to_bits() & 0x7fff_ffff;
        min[j] = if x < min[j] { x } else { min[j] };
        max[j] = if x > max[j] { x } else { max[j] };
        max_a[j] = max_a[j].max(a);
        // a - 1 wraps for zero, so zeros never win the minimum.
        min_nz[j] = min_nz[j].min(a.wrapping_sub(1));
        zeros[j] += (a == 0) as u32;
        edges[j] += (a & low_mask == 0) as u32;
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
        sum: 0.0,
        sum_sq: 0.0,
        min: min.iter().copied().fold(f32::INFINITY, f32::min),
        max: max.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        max_abs_bits: *max_a.iter().max().unwrap(),
        min_nonzero_abs_bits: min_nz.iter().min().unwrap().wrapping_add(1),
        zeros: zeros.iter().sum(),
        edges: edges.iter().sum(),
    }
}

/// Sum and sum of squares in float64, four lanes at a time (portable fallback).
fn moments_scalar(values: &[f32]) -> (f64, f64) {
    let (mut sum, mut sum_sq) = ([0f64; 4], [0f64; 4]);
    let mut blocks = values.chunks_exact(4);
    for block in &mut blocks {
        for (j, &x) in block.iter().enumerate() {
            let v = x as f64;
            sum[j] += v;
            sum_sq[j] += v * v;
        }
    }
    for &x in blocks.remainder() {
        sum[0] += x as f64;
        sum_sq[0] += (x as f64) * (x as f64);
    }
    (sum.iter().sum(), sum_sq.iter().sum())
}

/// `moments_scalar` with AVX2: the compiler pairs x with x*x instead of vectorizing across
/// values, so this is written out.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn moments_avx2(values: &[f32]) -> (f64, f64) {
    use std::arch::x86_64::*;
    let mut sum = [_mm256_setzero_pd(); 4];
    let mut sum_sq = [_mm256_setzero_pd(); 4];
    let mut blocks = values.chunks_exact(16);
    for block in &mut blocks {
        // SAFETY: the block holds 16 floats; unaligned loads are allowed.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(block.as_ptr()),
                _mm256_loadu_ps(block.as_ptr().add(8)),
            )
        };
        let wide = [
            _mm256_cvtps_pd(_mm256_castps256_ps128(lo)),
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(lo)),
            _mm256_cvtps_pd(_mm256_castps256_ps128(hi)),
            _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(hi)),
        ];
        for k in 0..4 {
            sum[k] = _mm256_add_pd(sum[k], wide[k]);
            sum_sq[k] = _mm256_add_pd(sum_sq[k], _mm256_mul_pd(wide[k], wide[k]));
        }
    }
    let (tail_sum, tail_sq) = moments_scalar(blocks.remainder());
    let (mut s, mut q) = ([0f64; 4], [0f64; 4]);
    let (mut total, mut total_sq) = (tail_sum, tail_sq);
    for k in 0..4 {
        // SAFETY: four doubles fit the arrays.
        unsafe {
            _mm256_storeu_pd(s.as_mut_ptr(), sum[k]);
            _mm256_storeu_pd(q.as_mut_ptr(), sum_sq[k]);
        }
        total += s.iter().sum::<f64>();
        total_sq += q.iter().sum::<f64>();
    }
    (total, total_sq)
}

/// `moments_avx2` with AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn moments_avx512(values: &[f32]) -> (f64, f64) {
    use std::arch::x86_64::*;
    let mut sum = [_mm512_setzero_pd(); 4];
    let mut sum_sq = [_mm512_setzero_pd(); 4];
    let mut blocks = values.chunks_exact(32);
    for block in &mut blocks {
        // SAFETY: the block holds 32 floats; unaligned loads are allowed.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_ps(block.as_ptr()),
                _mm512_loadu_ps(block.as_ptr().add(16)),
            )
        };
        let upper = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let wide = [
            _mm512_cvtps_pd(_mm512_castps512_ps256(lo)),
            _mm512_cvtps_pd(upper(lo)),
            _mm512_cvtps_pd(_mm512_castps512_ps256(hi)),
            _mm512_cvtps_pd(upper(hi)),
        ];
        for k in 0..4 {
            sum[k] = _mm512_add_pd(sum[k], wide[k]);
            sum_sq[k] = _mm512_fmadd_pd(wide[k], wide[k], sum_sq[k]);
        }
    }
    let (tail_sum, tail_sq) = moments_scalar(blocks.remainder());
    let (mut total, mut total_sq) = (tail_sum, tail_sq);
    for k in 0..4 {
        total += _mm512_reduce_add_pd(sum[k]);
        total_sq += _mm512_reduce_add_pd(sum_sq[k]);
    }
    (total, total_sq)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scan_avx512(values: &[f32], low_mask: u32) -> ChunkScan {
    let (sum, sum_sq) = unsafe { moments_avx512(values) };
    ChunkScan {
        sum,
        sum_sq,
        ..scan_bits::<16>(values, low_mask)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_avx2(values: &[f32], low_mask: u32) -> ChunkScan {
    let (sum, sum_sq) = unsafe { moments_avx2(values) };
    ChunkScan {
        sum,
        sum_sq,
        ..scan_bits::<8>(values, low_mask)
    }
}

/// The widest variant this CPU runs (chosen at run time: the wheel targets baseline x86-64).
fn scan(values: &[f32], low_mask: u32) -> ChunkScan {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { scan_avx512(values, low_mask) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { scan_avx2(values, low_mask) };
        }
    }
    scan_portable(values, low_mask)
}

/// The scan without SIMD instructions beyond the baseline.
fn scan_portable(values: &[f32], low_mask: u32) -> ChunkScan {
    let (sum, sum_sq) = moments_scalar(values);
    ChunkScan {
        sum,
        sum_sq,
        ..scan_bits::<8>(values, low_mask)
    }
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

/// Hint the CPU to fetch the cache line at `p` (a hint: it never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint and does not access memory architecturally.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Increment `table[lane][key]` for every value, all counters of one kind. While it works
/// from L1 it prefetches `ahead` (the next chunk's source bytes): otherwise memory would sit
/// idle for this half of the work and the next scan would wait on it.
#[inline(always)]
fn scatter(table: &mut [u32], width: usize, values: &[f32], drop: u32, ahead: &[u8]) {
    // Every key (|bits| >> drop) is below 2^(31 - drop) = width, so indexing cannot fail.
    assert!(width == 1usize << (31 - drop) && table.len() >= LANES * width);
    let mut keys = [0u32; CHUNK];
    let keys = &mut keys[..values.len()];
    for (k, x) in keys.iter_mut().zip(values) {
        *k = (x.to_bits() & 0x7fff_ffff) >> drop;
    }
    let base = table.as_mut_ptr();
    let bump = |lane: usize, key: u32| {
        // SAFETY: key < width (above) and lane < LANES, inside `table`.
        unsafe { *base.add(lane * width + key as usize) += 1 };
    };
    let lines = ahead.len().div_ceil(64).max(1);
    let quads_per_line = (keys.len() / LANES / lines).max(1);
    let mut quads = keys.chunks_exact(LANES);
    let mut line = 0;
    while quads.len() > 0 {
        if line * 64 < ahead.len() {
            prefetch(ahead[line * 64..].as_ptr());
        }
        line += 1;
        for q in (&mut quads).take(quads_per_line) {
            bump(0, q[0]);
            bump(1, q[1]);
            bump(2, q[2]);
            bump(3, q[3]);
        }
    }
    for &k in quads.remainder() {
        bump(0, k);
    }
}

/// The bytes of the chunk after chunk `i` (empty after the last).
fn next_chunk_bytes<T>(values: &[T], i: usize) -> &[u8] {
    let start = ((i + 1) * CHUNK).min(values.len());
    let end = ((i + 2) * CHUNK).min(values.len());
    let next = &values[start..end];
    // SAFETY: any initialized memory can be viewed as bytes; only its address is used.
    unsafe { std::slice::from_raw_parts(next.as_ptr().cast::<u8>(), std::mem::size_of_val(next)) }
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
        for (i, chunk) in values.chunks(CHUNK).enumerate() {
            self.feed_chunk(chunk, next_chunk_bytes(values, i));
        }
    }

    /// Add values of another type, converted to float32 one chunk at a time.
    pub fn feed_converted<T>(&mut self, values: &[T], convert: fn(&[T], &mut [f32])) {
        let mut buffer = [0f32; CHUNK];
        for (i, chunk) in values.chunks(CHUNK).enumerate() {
            let out = &mut buffer[..chunk.len()];
            convert(chunk, out);
            self.feed_chunk(out, next_chunk_bytes(values, i));
        }
    }

    /// Add at most `CHUNK` values; `ahead` is what to prefetch meanwhile.
    fn feed_chunk(&mut self, chunk: &[f32], ahead: &[u8]) {
        let m = self.sketch.mantissa_bits();
        let drop = 23 - m;
        let low_mask = (1u32 << drop) - 1;
        let scan = scan(chunk, low_mask);
        if scan.max_abs_bits >= F32_INF_BITS {
            for &x in chunk {
                self.sketch.insert_reference(x, self.source);
            }
            return;
        }
        let s = &mut *self.sketch;
        s.count += chunk.len() as u64;
        s.zeros += scan.zeros as u64;
        s.sum += scan.sum;
        s.sum_sq += scan.sum_sq;
        s.min = s.min.min(scan.min);
        s.max = s.max.max(scan.max);
        let subnormal_below = self.source.subnormal_below_bits();
        // Float32 subnormals go straight to the histogram; the scratch ignores their keys.
        let (mut f32_subnormals, mut f32_subnormal_edges) = (0u32, 0u32);
        if scan.min_nonzero_abs_bits < subnormal_below.max(F32_MIN_NORMAL_BITS) {
            for &x in chunk {
                let a = x.to_bits() & 0x7fff_ffff;
                if a.wrapping_sub(1) < subnormal_below - 1 {
                    s.subnormals += 1;
                }
                if a != 0 && a < F32_MIN_NORMAL_BITS {
                    let (key, edge) = histogram::key_of(a, m);
                    s.hist.add(key, 1, edge as u64);
                    f32_subnormals += 1;
                    f32_subnormal_edges += (a & low_mask == 0) as u32;
                }
            }
        }
        let normals = chunk.len() as u32 - scan.zeros - f32_subnormals;
        if normals == 0 {
            return;
        }
        let normal_edges = scan.edges - scan.zeros - f32_subnormal_edges;
        let scratch = self.scratch.get_or_insert_with(|| take_scratch(m));
        let width = scratch.width();
        let (off_edge, on_edge) = scratch.counters.split_at_mut(LANES * width);
        if normal_edges == 0 {
            scatter(off_edge, width, chunk, drop, ahead);
        } else if normal_edges == normals {
            scatter(on_edge, width, chunk, drop, ahead);
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
            .min(scan.min_nonzero_abs_bits.max(F32_MIN_NORMAL_BITS) >> drop);
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

    #[test]
    fn every_scan_variant_agrees() {
        let values = lcg_values(CHUNK - 3, 5, |r| match r % 50 {
            0 => 0.0,
            1 => 2.0,
            _ => (r % 100_000) as f32 * 1e-3 - 50.0,
        });
        let low_mask = (1 << 16) - 1;
        let want = scan_portable(&values, low_mask);
        let mut variants = vec![];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                variants.push(unsafe { scan_avx2(&values, low_mask) });
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                variants.push(unsafe { scan_avx512(&values, low_mask) });
            }
        }
        for got in variants {
            assert_eq!(
                (
                    got.min,
                    got.max,
                    got.max_abs_bits,
                    got.min_nonzero_abs_bits,
                    got.zeros,
                    got.edges
                ),
                (
                    want.min,
                    want.max,
                    want.max_abs_bits,
                    want.min_nonzero_abs_bits,
                    want.zeros,
                    want.edges
                )
            );
            assert!((got.sum - want.sum).abs() <= 1e-9 * want.sum_sq.sqrt() * 50.0);
            assert!((got.sum_sq - want.sum_sq).abs() <= 1e-12 * want.sum_sq);
        }
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
