//! A log-bucketed histogram of |x| keyed on the bits of float32 values.
//!
//! A finite nonzero float32 magnitude is `2^e * (1 + f)` with `e` in `[-149, 127]` once
//! subnormals are normalized (their leading one shifted into place). Its bucket is `e` and
//! the top `m` bits of `f`: bucket `[2^e (1 + j/2^m), 2^e (1 + (j+1)/2^m))`, relative width
//! 2^-m. For a normal float32 the key is the value's bits shifted right, so the hot loop
//! only shifts and counts.
//!
//! Besides the count, each bucket keeps how many of its values sit exactly on its lower
//! edge. Values of a narrower format (bfloat16 with m >= 7, float16 with m >= 10) are all
//! edges, so their quantiles are exact; and every FP8 range-fit threshold at a power-of-two
//! scale is a bucket edge, so the fit can place those values exactly (see `range_fit`).

use crate::fp8::pow2_f64;

/// Exponent of the smallest float32 subnormal.
pub const MIN_EXPONENT: i32 = -149;
/// Exponent of the largest float32 binade.
pub const MAX_EXPONENT: i32 = 127;
/// Binades from 2^-149 to 2^127.
pub const OCTAVES: u32 = (MAX_EXPONENT - MIN_EXPONENT + 1) as u32;
/// Bucket resolution limits: 3 bits put every FP8 range-fit threshold on a bucket edge;
/// 10 bits resolve float16 exactly and keep a sketch under a few megabytes.
pub const MIN_MANTISSA_BITS: u32 = 3;
pub const MAX_MANTISSA_BITS: u32 = 10;
/// Float32 bits of |x| below this are zero or subnormal.
pub const F32_MIN_NORMAL_BITS: u32 = 0x0080_0000;
/// Float32 bits of |x| at or above this are infinite or NaN.
pub const F32_INF_BITS: u32 = 0x7f80_0000;

/// Bucket key and whether the value lies on the bucket's lower edge, for the float32 bits
/// `a` of a finite nonzero magnitude.
#[inline]
pub fn key_of(a: u32, mantissa_bits: u32) -> (u32, bool) {
    debug_assert!(a != 0 && a < F32_INF_BITS);
    let drop = 23 - mantissa_bits;
    let low_mask = (1u32 << drop) - 1;
    if a >= F32_MIN_NORMAL_BITS {
        let key = (a >> drop) + (22 << mantissa_bits);
        (key, a & low_mask == 0)
    } else {
        // Subnormal: a is the 23-bit mantissa with exponent -149. Shift its leading one to
        // bit 23 and the rest reads like a normal mantissa of a lower binade.
        let leading = a.leading_zeros() - 9; // zeros inside the 23-bit field, 0..=22
        let normalized = (a << (leading + 1)) & 0x007f_ffff;
        let binade = 22 - leading; // e + 149 for e = -127 - leading
        let key = (binade << mantissa_bits) | (normalized >> drop);
        (key, normalized & low_mask == 0)
    }
}

/// Canonical key of a normal float32 whose shifted bits are `raw = a >> (23 - m)`.
#[inline]
pub fn key_of_raw_normal(raw: u32, mantissa_bits: u32) -> u32 {
    raw + (22 << mantissa_bits)
}

/// Number of keys for a resolution.
pub fn key_count(mantissa_bits: u32) -> u32 {
    OCTAVES << mantissa_bits
}

/// Binary exponent `e` of the values in a bucket (2^e <= |x| < 2^(e+1)).
pub fn exponent_of_key(key: u32, mantissa_bits: u32) -> i32 {
    (key >> mantissa_bits) as i32 + MIN_EXPONENT
}

/// Lower edge of a bucket: the smallest value it can hold (exact in float64 and float32).
pub fn lower_edge(key: u32, mantissa_bits: u32) -> f64 {
    let e = exponent_of_key(key, mantissa_bits);
    let j = key & ((1 << mantissa_bits) - 1);
    pow2_f64(e) * (1.0 + j as f64 / (1u32 << mantissa_bits) as f64)
}

/// Upper edge of a bucket (exclusive).
pub fn upper_edge(key: u32, mantissa_bits: u32) -> f64 {
    let e = exponent_of_key(key, mantissa_bits);
    lower_edge(key, mantissa_bits) + pow2_f64(e - mantissa_bits as i32)
}

/// The value that stands for the bucket's off-edge values: the harmonic mean of its edges,
/// whose relative distance to any value of the bucket is at most `(hi-lo)/(hi+lo)`,
/// i.e. below 2^-(m+1).
pub fn representative(key: u32, mantissa_bits: u32) -> f64 {
    let lo = lower_edge(key, mantissa_bits);
    let hi = upper_edge(key, mantissa_bits);
    2.0 * lo * hi / (lo + hi)
}

/// Counts per bucket over a contiguous key range that grows to cover what it is fed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogHistogram {
    mantissa_bits: u32,
    first_key: u32,
    counts: Vec<u64>,
    edges: Vec<u64>,
}

impl LogHistogram {
    pub fn new(mantissa_bits: u32) -> Self {
        assert!((MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS).contains(&mantissa_bits));
        LogHistogram {
            mantissa_bits,
            first_key: 0,
            counts: Vec::new(),
            edges: Vec::new(),
        }
    }

    pub fn mantissa_bits(&self) -> u32 {
        self.mantissa_bits
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Key range held, `first..first + len` (empty when nothing was counted).
    pub fn key_range(&self) -> (u32, u32) {
        (self.first_key, self.first_key + self.counts.len() as u32)
    }

    /// Grow the held range to include keys `lo..=hi`.
    pub fn reserve_keys(&mut self, lo: u32, hi: u32) {
        debug_assert!(lo <= hi && hi < key_count(self.mantissa_bits));
        if self.counts.is_empty() {
            self.first_key = lo;
            self.counts = vec![0; (hi - lo + 1) as usize];
            self.edges = vec![0; (hi - lo + 1) as usize];
            return;
        }
        let end = self.first_key + self.counts.len() as u32;
        if hi >= end {
            self.counts.resize((hi + 1 - self.first_key) as usize, 0);
            self.edges.resize((hi + 1 - self.first_key) as usize, 0);
        }
        if lo < self.first_key {
            let extra = (self.first_key - lo) as usize;
            self.counts.splice(0..0, std::iter::repeat_n(0, extra));
            self.edges.splice(0..0, std::iter::repeat_n(0, extra));
            self.first_key = lo;
        }
    }

    /// Add `count` values to bucket `key`, `edges` of them on its lower edge.
    #[inline]
    pub fn add(&mut self, key: u32, count: u64, edges: u64) {
        debug_assert!(edges <= count);
        let end = self.first_key + self.counts.len() as u32;
        if self.counts.is_empty() || key < self.first_key || key >= end {
            self.reserve_keys(key, key);
        }
        let i = (key - self.first_key) as usize;
        self.counts[i] += count;
        self.edges[i] += edges;
    }

    /// Mutable views of the counts and edge counts of keys `lo..lo + len` (reserved first).
    pub fn slots_mut(&mut self, lo: u32, len: usize) -> (&mut [u64], &mut [u64]) {
        self.reserve_keys(lo, lo + len as u32 - 1);
        let start = (lo - self.first_key) as usize;
        (
            &mut self.counts[start..start + len],
            &mut self.edges[start..start + len],
        )
    }

    /// Buckets holding values: `(key, count, edges)`, ascending.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
        self.counts
            .iter()
            .zip(&self.edges)
            .enumerate()
            .filter(|(_, (&c, _))| c > 0)
            .map(move |(i, (&c, &e))| (self.first_key + i as u32, c, e))
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Add another histogram of the same resolution.
    pub fn merge(&mut self, other: &LogHistogram) {
        assert_eq!(self.mantissa_bits, other.mantissa_bits);
        if other.counts.is_empty() {
            return;
        }
        let (lo, end) = other.key_range();
        let (counts, edges) = self.slots_mut(lo, (end - lo) as usize);
        for (c, o) in counts.iter_mut().zip(&other.counts) {
            *c += o;
        }
        for (e, o) in edges.iter_mut().zip(&other.edges) {
            *e += o;
        }
    }

    /// Drop empty buckets at both ends, so equal contents have equal representations.
    pub fn trim(&mut self) {
        let Some(first) = self.counts.iter().position(|&c| c > 0) else {
            self.counts.clear();
            self.edges.clear();
            self.first_key = 0;
            return;
        };
        let last = self.counts.iter().rposition(|&c| c > 0).unwrap();
        self.counts.truncate(last + 1);
        self.edges.truncate(last + 1);
        self.counts.drain(..first);
        self.edges.drain(..first);
        self.first_key += first as u32;
    }

    /// Raw parts for serialization: first key, counts, edge counts.
    pub fn parts(&self) -> (u32, &[u64], &[u64]) {
        (self.first_key, &self.counts, &self.edges)
    }

    /// Rebuild from parts, checking they describe a valid histogram.
    pub fn from_parts(
        mantissa_bits: u32,
        first_key: u32,
        counts: Vec<u64>,
        edges: Vec<u64>,
    ) -> Result<Self, String> {
        if !(MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS).contains(&mantissa_bits) {
            return Err(format!("mantissa_bits {mantissa_bits} out of range"));
        }
        if counts.len() != edges.len() {
            return Err("histogram counts and edge counts differ in length".into());
        }
        if first_key as u64 + counts.len() as u64 > key_count(mantissa_bits) as u64 {
            return Err("histogram key range exceeds the float32 range".into());
        }
        if counts.iter().zip(&edges).any(|(c, e)| e > c) {
            return Err("histogram has more edge values than values in a bucket".into());
        }
        let mut h = LogHistogram {
            mantissa_bits,
            first_key,
            counts,
            edges,
        };
        h.trim();
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_of_normals_and_subnormals_bracket_the_value() {
        for m in [MIN_MANTISSA_BITS, 7, MAX_MANTISSA_BITS] {
            for a in [
                1u32,
                2,
                3,
                0x7f,
                0x0040_0000,
                0x007f_ffff,
                0x0080_0000,
                0x3f80_0000,
                0x3fc0_0001,
                0x7f7f_ffff,
            ] {
                let v = f32::from_bits(a) as f64;
                let (k, edge) = key_of(a, m);
                assert!(
                    lower_edge(k, m) <= v && v < upper_edge(k, m),
                    "m={m} a={a:#x}"
                );
                assert_eq!(edge, lower_edge(k, m) == v, "m={m} a={a:#x}");
            }
        }
    }

    #[test]
    fn extreme_keys_stay_in_range() {
        let m = 7;
        assert_eq!(key_of(1, m).0, 0);
        assert_eq!(key_of(0x7f7f_ffff, m).0, key_count(m) - 1);
    }

    proptest! {
        #[test]
        fn every_finite_value_lands_in_its_bucket(a in 1u32..F32_INF_BITS, m in MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS) {
            let v = f32::from_bits(a) as f64;
            let (k, edge) = key_of(a, m);
            prop_assert!(k < key_count(m));
            prop_assert!(lower_edge(k, m) <= v && v < upper_edge(k, m));
            prop_assert_eq!(edge, lower_edge(k, m) == v);
            let r = representative(k, m);
            prop_assert!((r - v).abs() <= v * 0.5f64.powi(m as i32 + 1));
        }

        #[test]
        fn keys_are_monotone(a in 1u32..F32_INF_BITS - 1, m in MIN_MANTISSA_BITS..=MAX_MANTISSA_BITS) {
            prop_assert!(key_of(a, m).0 <= key_of(a + 1, m).0);
        }
    }

    #[test]
    fn merge_adds_and_trim_normalizes() {
        let mut a = LogHistogram::new(7);
        a.add(100, 3, 1);
        let mut b = LogHistogram::new(7);
        b.add(50, 2, 0);
        b.add(100, 1, 1);
        a.merge(&b);
        let got: Vec<_> = a.iter().collect();
        assert_eq!(got, vec![(50, 2, 0), (100, 4, 2)]);
        a.reserve_keys(10, 200);
        a.trim();
        assert_eq!(a.key_range(), (50, 101));
    }
}
