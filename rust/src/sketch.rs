//! The sketch of one tensor's values: exact counters, moments and the log histogram of |x|.

use crate::histogram::{self, LogHistogram};
use crate::ingest::{bf16_to_f32, f16_to_f32, Ingestor, Source, SMALL_UPDATE};

/// Default quantile resolution: relative error 2^-8.
pub const DEFAULT_MANTISSA_BITS: u32 = 7;

/// Distributions that `update_rows` adds beside the values themselves.
#[derive(Clone, Debug)]
pub struct RowSketches {
    /// Width of the 1 x `block` tiles along a row.
    pub block: u32,
    /// One value per row: the row's amax (over its finite values).
    pub row_amax: Sketch,
    /// One value per 1 x `block` tile: the tile's amax.
    pub block_amax: Sketch,
    /// |x| / amax of its row, per value (values of all-zero rows stay 0).
    pub row_normalized: Sketch,
    /// |x| / amax of its tile, per value.
    pub block_normalized: Sketch,
}

/// Streaming, mergeable statistics of a stream of float values.
#[derive(Clone, Debug)]
pub struct Sketch {
    pub(crate) hist: LogHistogram,
    pub(crate) count: u64,
    pub(crate) zeros: u64,
    pub(crate) subnormals: u64,
    pub(crate) nan: u64,
    pub(crate) pos_inf: u64,
    pub(crate) neg_inf: u64,
    /// Signed extremes over finite values (+inf / -inf while there are none).
    pub(crate) min: f32,
    pub(crate) max: f32,
    pub(crate) sum: f64,
    pub(crate) sum_sq: f64,
    pub(crate) rows: Option<Box<RowSketches>>,
}

impl Default for Sketch {
    fn default() -> Self {
        Sketch::new(DEFAULT_MANTISSA_BITS)
    }
}

impl Sketch {
    /// An empty sketch. Panics if `mantissa_bits` is outside `MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS`
    /// (the bindings check first).
    pub fn new(mantissa_bits: u32) -> Self {
        Sketch {
            hist: LogHistogram::new(mantissa_bits),
            count: 0,
            zeros: 0,
            subnormals: 0,
            nan: 0,
            pos_inf: 0,
            neg_inf: 0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            sum: 0.0,
            sum_sq: 0.0,
            rows: None,
        }
    }

    pub fn mantissa_bits(&self) -> u32 {
        self.hist.mantissa_bits()
    }

    /// The guaranteed bound on the relative error of every quantile: 2^-(m+1).
    pub fn relative_error(&self) -> f64 {
        0.5f64.powi(self.mantissa_bits() as i32 + 1)
    }

    pub fn count(&self) -> u64 {
        self.count
    }
    pub fn zeros(&self) -> u64 {
        self.zeros
    }
    pub fn subnormals(&self) -> u64 {
        self.subnormals
    }
    pub fn nan(&self) -> u64 {
        self.nan
    }
    pub fn pos_inf(&self) -> u64 {
        self.pos_inf
    }
    pub fn neg_inf(&self) -> u64 {
        self.neg_inf
    }
    pub fn finite(&self) -> u64 {
        self.count - self.nan - self.pos_inf - self.neg_inf
    }
    /// Smallest finite value (NaN when there is none).
    pub fn min(&self) -> f64 {
        if self.finite() == 0 {
            f64::NAN
        } else {
            self.min as f64
        }
    }
    /// Largest finite value (NaN when there is none).
    pub fn max(&self) -> f64 {
        if self.finite() == 0 {
            f64::NAN
        } else {
            self.max as f64
        }
    }
    /// Largest finite |x| (0 when there is none, so that the dynamic scale rule gives 1).
    pub fn amax(&self) -> f64 {
        if self.finite() == 0 {
            0.0
        } else {
            (self.min as f64).abs().max((self.max as f64).abs())
        }
    }
    /// Sum of the finite values.
    pub fn sum(&self) -> f64 {
        self.sum
    }
    /// Sum of squares of the finite values.
    pub fn sum_sq(&self) -> f64 {
        self.sum_sq
    }
    pub fn mean(&self) -> f64 {
        self.sum / self.finite() as f64
    }
    pub fn rms(&self) -> f64 {
        (self.sum_sq / self.finite() as f64).sqrt()
    }
    pub fn histogram(&self) -> &LogHistogram {
        &self.hist
    }
    pub fn rows(&self) -> Option<&RowSketches> {
        self.rows.as_deref()
    }

    /// Add float32 values.
    pub fn update_f32(&mut self, values: &[f32]) {
        if values.len() < SMALL_UPDATE {
            for &x in values {
                self.insert_reference(x, Source::F32);
            }
            return;
        }
        let mut ingest = Ingestor::new(self, Source::F32);
        ingest.feed(values);
        ingest.finish();
    }

    /// Add float16 values.
    pub fn update_f16(&mut self, values: &[half::f16]) {
        if values.len() < SMALL_UPDATE {
            for &x in values {
                self.insert_reference(x.to_f32(), Source::F16);
            }
            return;
        }
        let mut ingest = Ingestor::new(self, Source::F16);
        ingest.feed_converted(values, f16_to_f32);
        ingest.finish();
    }

    /// Add bfloat16 values given as their 16-bit patterns.
    pub fn update_bf16(&mut self, bits: &[u16]) {
        if bits.len() < SMALL_UPDATE {
            for &b in bits {
                self.insert_reference(f32::from_bits((b as u32) << 16), Source::Bf16);
            }
            return;
        }
        let mut ingest = Ingestor::new(self, Source::Bf16);
        ingest.feed_converted(bits, bf16_to_f32);
        ingest.finish();
    }

    /// The one-value-at-a-time definition of an update, which the fast path must match
    /// (counts and histogram exactly; sums up to summation order).
    pub fn insert_reference(&mut self, x: f32, source: Source) {
        let bits = x.to_bits();
        let a = bits & 0x7fff_ffff;
        self.count += 1;
        if a > histogram::F32_INF_BITS {
            self.nan += 1;
            return;
        }
        if a == histogram::F32_INF_BITS {
            if bits >> 31 == 0 {
                self.pos_inf += 1;
            } else {
                self.neg_inf += 1;
            }
            return;
        }
        let v = x as f64;
        self.sum += v;
        self.sum_sq += v * v;
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        if a == 0 {
            self.zeros += 1;
            return;
        }
        if a < source.subnormal_below_bits() {
            self.subnormals += 1;
        }
        let (key, edge) = histogram::key_of(a, self.mantissa_bits());
        self.hist.add(key, 1, edge as u64);
    }

    /// Fold another sketch into this one. Counts and histogram add exactly; sums add in
    /// float64. Both must have the same resolution and, if both have row distributions,
    /// the same block width.
    pub fn merge(&mut self, other: &Sketch) -> Result<(), String> {
        if self.mantissa_bits() != other.mantissa_bits() {
            return Err(format!(
                "cannot merge sketches of different resolution: mantissa_bits {} and {}",
                self.mantissa_bits(),
                other.mantissa_bits()
            ));
        }
        if let (Some(a), Some(b)) = (&self.rows, &other.rows) {
            if a.block != b.block {
                return Err(format!(
                    "cannot merge row distributions of different block widths: {} and {}",
                    a.block, b.block
                ));
            }
        }
        self.merge_values(other);
        match (&mut self.rows, &other.rows) {
            (Some(a), Some(b)) => {
                a.row_amax.merge_values(&b.row_amax);
                a.block_amax.merge_values(&b.block_amax);
                a.row_normalized.merge_values(&b.row_normalized);
                a.block_normalized.merge_values(&b.block_normalized);
            }
            (None, Some(b)) => self.rows = Some(b.clone()),
            _ => {}
        }
        Ok(())
    }

    fn merge_values(&mut self, other: &Sketch) {
        self.hist.merge(&other.hist);
        self.count += other.count;
        self.zeros += other.zeros;
        self.subnormals += other.subnormals;
        self.nan += other.nan;
        self.pos_inf += other.pos_inf;
        self.neg_inf += other.neg_inf;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
        self.sum_sq += other.sum_sq;
    }

    /// `{binary exponent e: number of finite values with 2^e <= |x| < 2^(e+1)}`, exact,
    /// ascending by exponent; zeros are not included (see `zeros`).
    pub fn exponent_histogram(&self) -> Vec<(i32, u64)> {
        let m = self.mantissa_bits();
        let mut out: Vec<(i32, u64)> = Vec::new();
        for (key, count, _) in self.hist.iter() {
            let e = histogram::exponent_of_key(key, m);
            match out.last_mut() {
                Some((last, c)) if *last == e => *c += count,
                _ => out.push((e, count)),
            }
        }
        out
    }

    /// Quantiles of |x| over the finite values, numpy's default ('linear') definition,
    /// each within `relative_error()` of the exact one. `None` when there are no finite
    /// values; every q must lie in [0, 1].
    pub fn quantiles(&self, qs: &[f64]) -> Option<Vec<f64>> {
        let n = self.finite();
        if n == 0 {
            return None;
        }
        assert!(qs.iter().all(|q| (0.0..=1.0).contains(q)));
        let positions: Vec<(u64, f64)> = qs
            .iter()
            .map(|&q| {
                let h = (n - 1) as f64 * q;
                let k = (h.floor() as u64).min(n - 1);
                (k, h - k as f64)
            })
            .collect();
        let mut ranks: Vec<u64> = positions
            .iter()
            .flat_map(|&(k, t)| if t > 0.0 { vec![k, k + 1] } else { vec![k] })
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        let values = self.order_statistics(&ranks);
        let value_at = |r: u64| values[ranks.binary_search(&r).unwrap()];
        Some(
            positions
                .iter()
                .map(|&(k, t)| {
                    if t > 0.0 {
                        lerp(value_at(k), value_at(k + 1), t)
                    } else {
                        value_at(k)
                    }
                })
                .collect(),
        )
    }

    /// Estimated |x| of the finite values at the given ascending 0-based ranks.
    fn order_statistics(&self, ranks: &[u64]) -> Vec<f64> {
        let m = self.mantissa_bits();
        let amax = self.amax();
        let last = self.finite() - 1;
        let mut out = Vec::with_capacity(ranks.len());
        let mut ranks = ranks.iter().copied().peekable();
        while let Some(&r) = ranks.peek() {
            if r >= self.zeros {
                break;
            }
            out.push(0.0);
            ranks.next();
        }
        let mut below = self.zeros;
        for (key, count, edges) in self.hist.iter() {
            while let Some(&r) = ranks.peek() {
                if r >= below + count {
                    break;
                }
                let value = if r == last {
                    amax
                } else if r - below < edges {
                    histogram::lower_edge(key, m)
                } else {
                    histogram::representative(key, m).min(amax)
                };
                out.push(value);
                ranks.next();
            }
            below += count;
        }
        out
    }

    /// Start the distributions of `update_rows` (or check the block width matches).
    pub(crate) fn rows_mut(&mut self, block: u32) -> Result<&mut RowSketches, String> {
        let m = self.mantissa_bits();
        let rows = self.rows.get_or_insert_with(|| {
            Box::new(RowSketches {
                block,
                row_amax: Sketch::new(m),
                block_amax: Sketch::new(m),
                row_normalized: Sketch::new(m),
                block_normalized: Sketch::new(m),
            })
        });
        if rows.block != block {
            return Err(format!(
                "block distributions built with block={} cannot take block={block}",
                rows.block
            ));
        }
        Ok(rows)
    }
}

/// numpy's interpolation between neighbouring order statistics.
fn lerp(a: f64, b: f64, t: f64) -> f64 {
    if t >= 0.5 {
        b - (b - a) * (1.0 - t)
    } else {
        a + (b - a) * t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// numpy.quantile(|x|, q) over the finite values, method 'linear'.
    fn exact_quantile(values: &[f32], q: f64) -> f64 {
        let mut a: Vec<f64> = values
            .iter()
            .filter(|x| x.is_finite())
            .map(|x| x.abs() as f64)
            .collect();
        a.sort_by(|x, y| x.partial_cmp(y).unwrap());
        let h = (a.len() - 1) as f64 * q;
        let k = h.floor() as usize;
        if k + 1 < a.len() {
            lerp(a[k], a[k + 1], h - k as f64)
        } else {
            a[k]
        }
    }

    fn finite_or_special() -> impl Strategy<Value = f32> {
        prop_oneof![
            8 => any::<f32>(),
            4 => -1e3f32..1e3f32,
            1 => Just(0.0f32),
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => (1u32..0x80_0000).prop_map(f32::from_bits),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn quantiles_are_within_the_bound(values in proptest::collection::vec(finite_or_special(), 1..3000), m in 3u32..=10) {
            let mut s = Sketch::new(m);
            s.update_f32(&values);
            prop_assume!(s.finite() > 0);
            let qs = [0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0];
            let got = s.quantiles(&qs).unwrap();
            for (&q, &g) in qs.iter().zip(&got) {
                let want = exact_quantile(&values, q);
                prop_assert!((g - want).abs() <= s.relative_error() * want * (1.0 + 1e-12),
                    "q={} got {} want {}", q, g, want);
            }
            prop_assert_eq!(got[got.len() - 1], s.amax());
        }

        #[test]
        fn merge_equals_the_sketch_of_the_union(a in proptest::collection::vec(finite_or_special(), 0..2000), b in proptest::collection::vec(finite_or_special(), 0..2000)) {
            let mut sa = Sketch::new(7);
            sa.update_f32(&a);
            let mut sb = Sketch::new(7);
            sb.update_f32(&b);
            sa.merge(&sb).unwrap();
            let mut union = Sketch::new(7);
            union.update_f32(&[a, b].concat());
            prop_assert_eq!(&sa.hist, &union.hist);
            prop_assert_eq!(
                (sa.count, sa.zeros, sa.subnormals, sa.nan, sa.pos_inf, sa.neg_inf),
                (union.count, union.zeros, union.subnormals, union.nan, union.pos_inf, union.neg_inf)
            );
            prop_assert_eq!(sa.amax(), union.amax());
        }
    }

    #[test]
    fn exponent_histogram_is_exact() {
        let values: Vec<f32> = (1..5000).map(|i| i as f32 * 0.37 - 900.0).collect();
        let mut s = Sketch::new(7);
        s.update_f32(&values);
        let mut expected = std::collections::BTreeMap::new();
        for &x in values.iter().filter(|&&x| x != 0.0) {
            let e = ((x.abs().to_bits() >> 23) as i32) - 127;
            *expected.entry(e).or_insert(0u64) += 1;
        }
        assert_eq!(
            s.exponent_histogram(),
            expected.into_iter().collect::<Vec<_>>()
        );
    }

    #[test]
    fn empty_and_special_only_sketches() {
        let mut s = Sketch::new(7);
        assert!(s.quantiles(&[0.5]).is_none());
        assert_eq!(s.amax(), 0.0);
        assert!(s.min().is_nan());
        s.update_f32(&[f32::NAN, f32::INFINITY]);
        assert!(s.quantiles(&[0.5]).is_none());
        assert_eq!((s.count(), s.finite()), (2, 0));
        let mut m10 = Sketch::new(10);
        assert!(s.merge(&m10).is_err());
        m10.update_f32(&[1.0]);
        assert_eq!(m10.quantiles(&[0.5]).unwrap(), vec![1.0]);
    }
}
